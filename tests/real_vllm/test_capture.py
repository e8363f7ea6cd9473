"""The `vllm` hidden-state backend on vLLM 0.32.0's own engine (CPU, float32) with its
`extract_hidden_states` method and our CUDA-free connector, compared with a transformers prefill of the
same ids: the auxiliary layers and layer N before the final norm (`final: raw`), through the project's
shard writer. One engine serves the module."""

import pytest
import torch

from eagle3_datagen.backends.hf.capture import HFCapture
from eagle3_datagen.backends.vllm.capture import VLLMCapture
from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.formats.hidden_shard import HiddenShard
from eagle3_datagen.stages.hidden.shard import capture_shard
from tests.helpers import HIDDEN_SETTINGS, make_samples
from tests.helpers.vllm_cpu import AUX, MAX_MODEL_LEN, TINY_QWEN3, TOLERANCE

WIDTH = TINY_QWEN3["hidden_size"]


@pytest.fixture(scope="module")
def capture(vllm_model_dir):
    """vLLM's engine in its own processes (its default), as the capture runner holds it; shut down with the
    module, while pytest's captured streams are open (at exit vLLM logs its shutdown into closed ones)."""
    engine = {"max_model_len": MAX_MODEL_LEN, "enforce_eager": True}
    capture = VLLMCapture(
        vllm_model_dir, AUX, fill_defaults({"dtype": "float32", "engine_args": engine}, "hidden_states.vllm")
    )
    yield capture
    capture.llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def reference(vllm_model_dir):
    return HFCapture(vllm_model_dir, AUX, "raw", {"dtype": "float32", "device": "cpu"})


def test_states_equal_a_transformers_prefill_and_leave_no_file(capture, reference):
    batch = [s["input_ids"] for s in make_samples(4, seed=7, lo=5, hi=60)]
    ours = capture(batch)
    expected = reference(batch)
    assert [aux.shape for aux, _ in ours] == [(len(ids), 3 * WIDTH) for ids in batch]
    assert [final.shape for _, final in ours] == [(len(ids), WIDTH) for ids in batch]
    worst = 0.0
    for (aux, final), (hf_aux, hf_final) in zip(ours, expected, strict=True):
        torch.testing.assert_close(aux, hf_aux, **TOLERANCE)
        torch.testing.assert_close(final, hf_final, **TOLERANCE)
        worst = max(worst, (aux - hf_aux).abs().max().item(), (final - hf_final).abs().max().item())
    print(f"largest difference from transformers: {worst:.2e}")
    assert list(capture.storage.iterdir()) == []  # each request's file removed once read


def test_the_last_slot_is_before_the_final_norm(capture, hf_model):
    ids = make_samples(1, seed=8, lo=20, hi=21)[0]["input_ids"]
    [(_, final)] = capture([ids])
    with torch.no_grad():
        normed = hf_model.model(torch.tensor([ids])).last_hidden_state[0]
    torch.testing.assert_close(hf_model.model.norm(final), normed, **TOLERANCE)
    assert not torch.allclose(final, normed, atol=1e-2)


def test_shards_hold_the_states_the_engine_computed(capture, reference, tmp_path):
    samples = make_samples(6, seed=9, lo=5, hi=40)
    index = capture_shard(samples, tmp_path / "shard", capture, {**HIDDEN_SETTINGS, "aux_layers": AUX, "final": "raw"})
    assert index["aux_layers"] == AUX and index["final"] == "raw"
    stored = list(HiddenShard(tmp_path / "shard"))
    assert [s["id"] for s in stored] == [s["id"] for s in samples]
    expected = reference([s["input_ids"] for s in samples])
    for sample, row, (hf_aux, hf_final) in zip(samples, stored, expected, strict=True):
        assert row["input_ids"].tolist() == sample["input_ids"]
        torch.testing.assert_close(row["aux_hidden_states"], hf_aux, **TOLERANCE)
        torch.testing.assert_close(row["hidden_states"], hf_final, **TOLERANCE)
    assert list(capture.storage.iterdir()) == []


def test_a_normed_final_the_layer_check_or_an_engine_in_process_is_refused_before_loading(vllm_model_dir, monkeypatch):
    model = {"path": str(vllm_model_dir), "trust_remote_code": False}
    hidden = {**HIDDEN_SETTINGS, "aux_layers": AUX, "final": "normed", "vllm": fill_defaults({}, "hidden_states.vllm")}
    with pytest.raises(ValueError, match="set hidden_states.final: raw"):
        VLLMCapture.for_job(hidden, model)
    with pytest.raises(ValueError, match="layer_check_samples: 0"):
        VLLMCapture.for_job({**hidden, "final": "raw", "layer_check_samples": 4}, model)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with pytest.raises(RuntimeError, match="unset VLLM_ENABLE_V1_MULTIPROCESSING"):
        VLLMCapture.for_job({**hidden, "final": "raw"}, model)
