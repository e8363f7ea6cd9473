"""The `sglang` hidden-state backend on SGLang 0.5.23's own model runner (tp=1, CPU, float32),
compared with the `hf` backend layer by layer: the session's tiny Qwen3 here, the target families'
architectures that run on SGLang's CPU path each in a process of its own (DeepSeek-V3's in
test_gpu_check.py)."""

from pathlib import Path

import pytest
import torch

from eagle3_datagen.backends.base import SingleProcess
from eagle3_datagen.backends.batching import capture_in_batches, plan_batches
from eagle3_datagen.backends.hf.capture import HFCapture
from eagle3_datagen.backends.sglang.capture import SGLangCapture, load_sglang_capture
from eagle3_datagen.chat.template import load_tokenizer
from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.diagnostics.gpu_check import agreement_by_layer, format_table, random_batch
from eagle3_datagen.targets.tiny_family import tiny_config, tiny_model, write_model_dir
from tests.helpers import TARGET_FILES, make_samples
from tests.helpers.sglang_cpu import CPU_CAPTURE_SETTINGS, MAX_BATCH_TOKENS

from .runner_process import capture_with_both_backends, in_own_process


def sglang_capture(runner, final="normed", aux="auto"):
    return SGLangCapture(runner, aux, final, ranks=SingleProcess())


@pytest.mark.parametrize("final", ["normed", "raw"])
def test_states_equal_the_hf_backend_layer_by_layer(qwen_runner, tiny_model_dir, final):
    batch = [s["input_ids"] for s in make_samples(5, seed=3)]
    batch = [ids[: MAX_BATCH_TOKENS // len(batch)] for ids in batch]
    sglang_states = sglang_capture(qwen_runner, final)(batch)
    hf_states = HFCapture(tiny_model_dir, "auto", final, {"dtype": "float32", "device": "cpu"})(batch)
    assert [aux.shape for aux, _ in sglang_states] == [(len(ids), 3 * 32) for ids in batch]
    for (aux, fin), (hf_aux, hf_fin) in zip(sglang_states, hf_states, strict=True):
        for layer in range(3):
            sl = slice(32 * layer, 32 * (layer + 1))
            torch.testing.assert_close(aux[:, sl], hf_aux[:, sl], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fin, hf_fin, atol=1e-5, rtol=1e-5)


def test_explicit_layers_are_the_ones_captured(qwen_runner, tiny_model_dir):
    batch = random_batch(512, samples=3, lo=3, hi=20)
    ours = sglang_capture(qwen_runner, aux=[1, 7])(batch)
    expected = HFCapture(tiny_model_dir, [1, 7], "normed", {"dtype": "float32", "device": "cpu"})(batch)
    for (aux, _), (hf_aux, _) in zip(ours, expected, strict=True):
        torch.testing.assert_close(aux, hf_aux, atol=1e-5, rtol=1e-5)
    assert qwen_runner.model.model.layers_to_capture == [1, 7]


def test_raw_and_normed_finals_differ_by_the_final_norm(qwen_runner):
    batch = [make_samples(1, seed=4)[0]["input_ids"][:MAX_BATCH_TOKENS]]
    [(_, raw)] = sglang_capture(qwen_runner, "raw")(batch)
    [(_, normed)] = sglang_capture(qwen_runner, "normed")(batch)
    torch.testing.assert_close(qwen_runner.model.model.norm(raw), normed, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(raw, normed)


def test_other_capture_numbering_is_refused(qwen_runner, monkeypatch):
    stack = qwen_runner.model.model
    monkeypatch.setattr(
        qwen_runner.model,
        "set_eagle3_layers_to_capture",
        lambda ids: setattr(stack, "layers_to_capture", [i + 2 for i in ids]),
    )
    with pytest.raises(RuntimeError, match=r"captures decoder-layer inputs \[4, 6, 7\] for requested hidden_states"):
        sglang_capture(qwen_runner)


def test_states_cut_short_are_refused(qwen_runner):
    from eagle3_datagen.backends.sglang.capture import _logits_processor

    capture = sglang_capture(qwen_runner)
    processor = _logits_processor(qwen_runner.model)
    originals = []

    def cut(_module, args):  # what a prefix-cache hit does: the cached tokens' states never come back
        originals.append(args)
        return (args[0], args[1][2:], args[2], args[3], [a[2:] for a in args[4]])

    hooks = [
        processor.register_forward_pre_hook(cut, prepend=True),
        processor.register_forward_pre_hook(lambda _module, _args: originals.pop()),  # SGLang itself gets all
    ]
    try:
        with pytest.raises(RuntimeError, match="prefix caching or chunked prefill must be off"):
            capture([[1, 2, 3, 4], [5, 6, 7]])
    finally:
        for hook in hooks:
            hook.remove()


def test_gpu_check_passes_equal_backends_and_names_a_wrong_layer(qwen_runner, tiny_model_dir):
    batch = random_batch(512, samples=6, lo=3, hi=20)
    reference = HFCapture(tiny_model_dir, "auto", "normed", {"dtype": "float32", "device": "cpu"})
    expected = capture_in_batches(reference, batch, MAX_BATCH_TOKENS)
    ours = capture_in_batches(sglang_capture(qwen_runner), batch, MAX_BATCH_TOKENS)
    rows = agreement_by_layer(ours, expected, [2, 4, 5], "normed")
    assert [r.layer for r in rows] == [
        "aux hidden_states[2]",
        "aux hidden_states[4]",
        "aux hidden_states[5]",
        "final (normed)",
    ]
    assert all(r.ok and r.min_cosine > 0.9999 for r in rows), format_table(rows)
    assert rows[0].tokens == sum(len(ids) for ids in batch)

    # An off-by-one the numbering check would not see: layer 6's states stored as layer 5's.
    wrong = sglang_capture(qwen_runner)
    qwen_runner.model.model.layers_to_capture = [2, 4, 6]
    rows = agreement_by_layer(capture_in_batches(wrong, batch, MAX_BATCH_TOKENS), expected, [2, 4, 5], "normed")
    assert [r.ok for r in rows] == [True, True, False, True]
    assert "MISMATCH" in format_table(rows).splitlines()[3]


def test_a_rank_that_does_not_write_runs_the_same_forward_passes(qwen_runner, monkeypatch):
    class Follower:
        writer = False

    extends = []
    monkeypatch.setattr(qwen_runner, "extend", lambda batch, run=qwen_runner.extend: extends.append(run(batch)))
    follower = SGLangCapture(qwen_runner, "auto", "normed", ranks=Follower())
    batch = random_batch(512, samples=5, lo=3, hi=30)
    assert capture_in_batches(follower, batch, MAX_BATCH_TOKENS) == [None] * 5
    assert len(extends) == len(plan_batches([len(ids) for ids in batch], MAX_BATCH_TOKENS, packed=True))


def test_packed_batches_budget_tokens_not_rows_times_longest():
    lengths = [5, 1, 9, 3, 3, 7, 2]
    packed = plan_batches(lengths, max_batch_tokens=12, packed=True)
    assert sorted(i for b in packed for i in b) == list(range(7))
    assert all(sum(lengths[i] for i in b) <= 12 for b in packed)
    assert len(packed) < len(plan_batches(lengths, max_batch_tokens=12))


def test_sglang_backend_needs_torchrun(monkeypatch, tmp_path):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="torchrun --nproc-per-node"):
        load_sglang_capture(tmp_path, "auto", "normed", fill_defaults({}, "hidden_states.sglang"), False, 64)


TINY_SIZES = {"seed": 0, "hidden_size": 32, "intermediate_size": 64, "num_layers": 8, "num_heads": 4, "num_kv_heads": 2}
TINY_MOE = {"routed_experts": 4, "experts_per_token": 2, "shared_experts": 0, "intermediate_size": 16}


def tiny_family_dir(folder: str, architecture: str, out: Path) -> Path:
    """A random tiny model of `architecture`, shrunk from the real config.json in the fixture folder, with its
    real tokenizer (as the families tier's targets are, unfitted)."""
    settings = {**TINY_SIZES, "architecture": architecture, "tokenizer": str(TARGET_FILES / folder), "moe": TINY_MOE}
    config = tiny_config(settings, load_tokenizer(TARGET_FILES / folder))
    write_model_dir(out, tiny_model(config, seed=1).eval(), config, TARGET_FILES / folder, {})
    return out


@pytest.mark.parametrize(
    ("folder", "architecture", "sglang_class"),
    [("qwen3", "qwen3_moe", "Qwen3MoeForCausalLM"), ("llama-3.1", "llama", "LlamaForCausalLM")],
    ids=["qwen3_moe", "llama"],
)
def test_a_familys_architecture_captures_as_the_hf_backend(folder, architecture, sglang_class, tmp_path):
    model_dir = tiny_family_dir(folder, architecture, tmp_path / "model")
    vocab_size = len(load_tokenizer(model_dir))
    batch = random_batch(vocab_size, samples=4, lo=3, hi=MAX_BATCH_TOKENS // 4)
    ran, sglang_states, hf_states = in_own_process(
        capture_with_both_backends, model_dir, batch, CPU_CAPTURE_SETTINGS, MAX_BATCH_TOKENS
    )
    assert ran == sglang_class
    assert [aux.shape for aux, _ in sglang_states] == [(len(ids), 3 * 32) for ids in batch]
    for (aux, final), (hf_aux, hf_final) in zip(sglang_states, hf_states, strict=True):
        torch.testing.assert_close(aux, hf_aux, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final, hf_final, atol=1e-5, rtol=1e-5)


def test_gpt_oss_does_not_run_on_sglangs_cpu_attention(tmp_path):
    """SGLang 0.5.23 refuses gpt-oss with torch_native, the attention backend these tests run ("neither
    sliding window nor attention sinks", its source says). Of the backends it accepts (triton, trtllm_mha,
    fa3, fa4, ascend, intel_amx, intel_xpu, aiter) only intel_amx is for CPUs, and it calls sgl-kernel's CPU
    operators, which have no build for this torch (cpu/sgl_kernel is import-only). When a release accepts
    torch_native, the capture above should take gpt-oss too."""
    model_dir = tiny_family_dir("gpt-oss", "gpt_oss", tmp_path / "model")
    refusal = r"(?s)GptOssForCausalLM requires one of .* attention backend.*Prefill: torch_native"
    with pytest.raises(AssertionError, match=refusal):
        in_own_process(capture_with_both_backends, model_dir, [[1, 2, 3]], CPU_CAPTURE_SETTINGS, MAX_BATCH_TOKENS)
