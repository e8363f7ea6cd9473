"""The smoke run's layer check (diagnostics/layer_check.py) on the tiny Kimi built from config/tiny-kimi.yaml:
the capture runner's own hooks (stages/hidden/layer_tap.py) record every layer while the `hf` capture writes
a shard, and the stored slots are compared with them. Three defects planted in the capture path each fail it,
naming the layer the slot does hold; the good capture passes."""

import pytest
import torch
import yaml

from eagle3_datagen.backends.hf.capture import HFCapture
from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.diagnostics import layer_check
from eagle3_datagen.formats.hidden_shard import layer_tap_path
from eagle3_datagen.stages.hidden.layer_tap import record_layers
from eagle3_datagen.stages.hidden.shard import capture_shard
from eagle3_datagen.targets.tiny_kimi import tiny_kimi_config, tiny_kimi_model
from tests.helpers import REPO

HF = {"dtype": "float32", "device": "cpu"}


@pytest.fixture(scope="module")
def unfitted_kimi_dir(tmp_path_factory, kimi_fast):
    """The tiny Kimi's DeepSeek-V3 (8 layers, MLA, MoE) from config/tiny-kimi.yaml's `demo`, seeded, unfitted."""
    demo = yaml.safe_load((REPO / "config/tiny-kimi.yaml").read_text())["demo"]
    path = tmp_path_factory.mktemp("tiny-kimi") / "model"
    tiny_kimi_model(tiny_kimi_config(demo, kimi_fast), demo["seed"]).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def samples(kimi_fast):
    texts = ["What is the capital of France?", "Write a haiku about rain.", "2+2=?", "Name three prime numbers."]
    texts += ["Explain recursion to a child in one sentence.", "Translate 'good morning' into German."]
    ids = [kimi_fast(t)["input_ids"] for t in texts]
    return [{"id": f"s{i}", "input_ids": x, "loss_mask": [1] * len(x)} for i, x in enumerate(ids)]


class Planted:
    """The `hf` capture with a defect in what it stores, its shard's index saying what it should hold."""

    def __init__(self, capture: HFCapture, aux_layers: list[int], final: str, stores_final: str):
        self.capture, self.stores_final = capture, stores_final
        self.packed, self.ranks, self.model = capture.packed, capture.ranks, capture.model
        self.model_name, self.num_layers, self.hidden_size = capture.model_name, capture.num_layers, capture.hidden_size
        self.aux_layers, self.final = aux_layers, final  # what the shard's index says

    def __call__(self, batch):
        self.capture.aux_layers, self.capture.final = self.aux_layers, self.stores_final
        return self.capture(batch)


def checked(tmp_path, capture, samples) -> list[dict]:
    """Capture a shard with `capture` and record its layers as the runner does; the check's rows."""
    settings = fill_defaults({"aux_layers": "auto", "dtype": "float32", "shard_bytes": 1 << 24}, "hidden_states")
    out = tmp_path / "hidden/00000"
    capture_shard(samples, out, capture, settings)
    assert record_layers(capture, capture.model, samples, 4, layer_tap_path(out)) == ["s2", "s3", "s0", "s1"]
    ok, rows = layer_check.check_layers(layer_tap_path(out), out, {}, "auto")
    assert ok == all(r["ok"] for r in rows)
    for r in rows:
        print(f"{r['slot']:<6} must hold {r['expected']:<18} cosine {r['cosine']:.4f} rel_err {r['rel_err']:.4f}")
    return rows


@pytest.fixture(scope="module")
def capture(unfitted_kimi_dir):
    return HFCapture(unfitted_kimi_dir, "auto", "raw", HF)


def test_the_hooks_record_what_transformers_computes_at_every_layer(tmp_path, capture, samples):
    ids = samples[2]["input_ids"]
    record_layers(capture, capture.model, samples[2:3], 1, tmp_path / "tap.safetensors")
    tap = layer_check.read_tap(tmp_path / "tap.safetensors")["s2"]
    assert layer_check.num_layers({"s2": tap}) == 8
    assert tap["positions"].tolist() == list(range(len(ids)))  # a short sample: every position
    capture.model.config.tie_last_hidden_states = False  # transformers would put the normed final at [N]
    with torch.inference_mode():
        out = capture.model.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    for i, layer in enumerate(out.hidden_states):
        assert torch.allclose(tap[f"hidden_states[{i}]"], layer[0], atol=1e-6)
    assert torch.allclose(tap["final, raw"], out.hidden_states[-1][0], atol=1e-6)
    assert torch.allclose(tap["final, normed"], out.last_hidden_state[0], atol=1e-6)


@pytest.mark.parametrize("final", ["raw", "normed"])
def test_a_good_capture_passes(tmp_path, unfitted_kimi_dir, samples, final):
    rows = checked(tmp_path, HFCapture(unfitted_kimi_dir, "auto", final, HF), samples)
    assert [(r["slot"], r["expected"]) for r in rows] == [
        ("aux 0", "hidden_states[2]"),
        ("aux 1", "hidden_states[4]"),
        ("aux 2", "hidden_states[5]"),
        ("final", f"final, {final}"),
    ]
    assert all(r["ok"] and r["cosine"] > 0.9999 and r["rel_err"] < 1e-5 for r in rows)


def test_reversed_auxiliary_layers_fail(tmp_path, capture, samples):
    rows = checked(tmp_path, Planted(capture, [5, 4, 2], "raw", "raw"), samples)
    wrong = {r["slot"]: r["best_match"] for r in rows if not r["ok"]}
    assert wrong == {"aux 0": "hidden_states[5]", "aux 2": "hidden_states[2]"}


def test_an_auxiliary_layer_id_one_off_fails(tmp_path, capture, samples):
    """SGLang's count (one lower than transformers' hidden_states) taken for transformers'."""
    rows = checked(tmp_path, Planted(capture, [1, 3, 4], "raw", "raw"), samples)
    wrong = {r["slot"]: r["best_match"] for r in rows if not r["ok"]}
    assert wrong == {"aux 0": "hidden_states[1]", "aux 1": "hidden_states[3]", "aux 2": "hidden_states[4]"}


def test_a_final_slot_without_its_norm_fails(tmp_path, capture, samples):
    rows = checked(tmp_path, Planted(capture, [2, 4, 5], "normed", "raw"), samples)
    wrong = {r["slot"]: r["best_match"] for r in rows if not r["ok"]}
    assert wrong == {"final": "final, raw"}
