"""vLLM's settings on the CPU, for tests/real_vllm (whose conftest.py applies the environment) and the
server it starts. Imports no vLLM."""

# vLLM sizes its CPU KV cache from this many GiB (its default, 4, is more than a shared CI machine spares).
VLLM_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
# The tiny Qwen3's shape (vLLM's CPU attention needs head_dim >= 32) and the engine's context.
TINY_QWEN3 = {"num_layers": 4, "hidden_size": 128, "intermediate_size": 256, "head_dim": 32}
MAX_MODEL_LEN = 1024
# The captured auxiliary layers: EAGLE-3's auto choice [2, N//2, N-3] needs 7 layers or more.
AUX = [1, 2, 3]
# float32 on both sides; vLLM's CPU kernels (its attention, its fused add + RMSNorm) sum in another order
# than transformers': the largest difference measured here was 1.2e-7 (AMD EPYC, AVX2), the issue's trial
# saw 1.6e-5 on another machine; states are of magnitude up to 5.
TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}
