"""SGLang 0.5.23 itself, on the CPU: `make test` runs this directory under .venv-sglang.

Everything computed here is SGLang's own code. cpu/ holds what it takes to run it on a CPU-only
machine: import-only `sgl_kernel` and `torchvision` (no CPU build of either fits torch 2.13.0's CPU
wheel; nothing of them is called), and `sglang_test_models`, the model files the tests load,
registered alone through SGLang's SGLANG_EXTERNAL_MODEL_PACKAGE (importing all of SGLang's model
files costs every process a minute), with DeepSeek's torch_native prefill routed to SGLang's
absorbed-MLA path. Subprocesses (torchrun ranks, the server) inherit the same settings.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.sglang_cpu import CPU_CAPTURE_SETTINGS, CPU_DIR, MAX_BATCH_TOKENS, SGLANG_CPU_ENV

os.environ.update(SGLANG_CPU_ENV)
sys.path.insert(0, str(CPU_DIR))

try:
    import sglang  # noqa: F401
except ImportError as error:  # run by plain `pytest` in the main venv: say how to run it
    raise ImportError("tests/real_sglang runs under .venv-sglang: use `make test` (or `make sglang-env`)") from error


def tiny_deepseek_v3(num_layers: int = 8):
    """A random DeepseekV3 (MLA + MoE, Kimi-K2.5's architecture) of width 32 (seed it first), with
    the keys SGLang reads from real DeepSeek/Kimi configs."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        max_position_embeddings=1024,
        rope_scaling={
            "type": "yarn",
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 256,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        moe_layer_freq=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        num_nextn_predict_layers=0,
    )
    return DeepseekV3ForCausalLM(config)


@pytest.fixture(scope="session")
def tiny_deepseek_dir(tmp_path_factory) -> Path:
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("deepseek") / "model"
    tiny_deepseek_v3().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def qwen_runner(tiny_model_dir):
    """SGLang's runner for the tiny Qwen3, tp=1 in this process (SGLang builds one per process)."""
    from eagle3_datagen.backends.sglang.capture import CPU_SERVER_FLAGS, SGLangModelRunner, server_flags

    flags = server_flags(tiny_model_dir, CPU_CAPTURE_SETTINGS, False, MAX_BATCH_TOKENS, tp_size=1)
    return SGLangModelRunner([*flags, *CPU_SERVER_FLAGS])


@pytest.fixture(scope="session")
def served_model_dir(tmp_path_factory, qwen_tokenizer) -> Path:
    """The tiny Qwen3 with Qwen's real tokenizer and chat template, as a server loads it."""
    from tests.helpers import tiny_qwen3

    torch.manual_seed(2)
    path = tmp_path_factory.mktemp("served") / "Tiny-Served"
    tiny_qwen3(len(qwen_tokenizer), num_layers=4).save_pretrained(path)
    qwen_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_model(served_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(served_model_dir, dtype=torch.float32).eval()
