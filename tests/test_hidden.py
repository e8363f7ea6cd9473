import json
import random

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from eagle3_datagen import hidden
from eagle3_datagen.hidden import HFCapture, HiddenShard, capture_shard, plan_batches, plan_parts, resolve_aux_layers

SETTINGS = {"dtype": "float32", "shard_bytes": 1 << 20, "max_batch_tokens": 64}


def make_samples(n, seed=0, lo=3, hi=40):
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        length = rng.randint(lo, hi)
        samples.append(
            {
                "id": f"s{i}",
                "input_ids": [rng.randrange(512) for _ in range(length)],
                "loss_mask": [int(k >= length // 2) for k in range(length)],
            }
        )
    return samples


@pytest.fixture(scope="module")
def capture(tiny_model_dir):
    return HFCapture(tiny_model_dir, "auto", "normed", {"dtype": "float32"})


def test_aux_layers_auto_is_eagle3_choice():
    assert resolve_aux_layers(61, "auto") == [2, 30, 58]
    assert resolve_aux_layers(8, "auto") == [2, 4, 5]
    assert resolve_aux_layers(8, [1, 7]) == [1, 7]
    with pytest.raises(ValueError, match="distinct hidden_states indices in 1..7"):
        resolve_aux_layers(8, [2, 8])  # the last layer's output is never an auxiliary state


def test_plans_cover_every_sample_once():
    lengths = [5, 1, 9, 3, 3, 7, 2]
    parts = plan_parts(lengths, bytes_per_token=10, shard_bytes=100)
    assert [list(p) for p in parts] == [[0, 1], [2], [3, 4], [5, 6]]
    batches = plan_batches(lengths, max_batch_tokens=10)
    assert sorted(i for b in batches for i in b) == list(range(7))
    assert all(len(b) * max(lengths[i] for i in b) <= 10 or len(b) == 1 for b in batches)


def test_stored_states_equal_a_direct_forward(tmp_path, capture, tiny_model_dir):
    samples = make_samples(13)  # 13 samples: batches and parts that do not divide the count
    index = capture_shard(samples, tmp_path / "shard", capture, {**SETTINGS, "shard_bytes": 40_000})
    assert index["aux_layers"] == [2, 4, 5] and index["final"] == "normed"
    assert len(index["parts"]) > 1
    shard = HiddenShard(tmp_path / "shard")
    assert shard.ids == [s["id"] for s in samples]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    for sample, stored in zip(samples, shard, strict=True):
        with torch.no_grad():
            out = model(torch.tensor([sample["input_ids"]]), output_hidden_states=True)
        expected_aux = torch.cat([out.hidden_states[i][0] for i in (2, 4, 5)], dim=-1)
        with torch.no_grad():
            expected_final = model.model(torch.tensor([sample["input_ids"]])).last_hidden_state[0]
        assert stored["id"] == sample["id"]
        assert stored["input_ids"].tolist() == sample["input_ids"]
        assert stored["loss_mask"].tolist() == sample["loss_mask"]
        torch.testing.assert_close(stored["aux_hidden_states"], expected_aux, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(stored["hidden_states"], expected_final, atol=1e-5, rtol=1e-4)
    assert shard["s7"]["input_ids"].tolist() == samples[7]["input_ids"]


def test_raw_final_is_the_last_layer_output(tmp_path, tiny_model_dir):
    raw = HFCapture(tiny_model_dir, [1, 3], "raw", {"dtype": "float32"})
    samples = make_samples(3)
    capture_shard(samples, tmp_path / "raw", raw, SETTINGS)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    stored = next(iter(HiddenShard(tmp_path / "raw")))
    captured = {}
    model.model.layers[-1].register_forward_hook(lambda m, a, o: captured.setdefault("last", o))
    with torch.no_grad():
        out = model(torch.tensor([samples[0]["input_ids"]]), output_hidden_states=True)
    last = captured["last"][0] if isinstance(captured["last"], tuple) else captured["last"]
    torch.testing.assert_close(stored["hidden_states"], last[0])
    expected_aux = torch.cat([out.hidden_states[1][0], out.hidden_states[3][0]], -1)
    torch.testing.assert_close(stored["aux_hidden_states"], expected_aux)
    HiddenShard(tmp_path / "raw").check_layout([1, 3], "raw")
    with pytest.raises(ValueError, match="do not match the configured"):
        HiddenShard(tmp_path / "raw").check_layout([2, 4, 5], "normed")


def test_batched_equals_one_at_a_time(capture):
    samples = make_samples(6, seed=3)
    together = capture([s["input_ids"] for s in samples])
    for sample, (aux, final) in zip(samples, together, strict=True):
        [(aux1, final1)] = capture([sample["input_ids"]])
        torch.testing.assert_close(aux, aux1, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(final, final1, atol=1e-5, rtol=1e-4)


def test_bytes_on_disk_are_tokens_times_bytes_per_token(tmp_path, capture):
    samples = make_samples(40, seed=5, lo=20, hi=200)
    index = capture_shard(samples, tmp_path / "s", capture, {**SETTINGS, "dtype": "bfloat16"})
    tensor_bytes = index["tokens"] * index["bytes_per_token"] + 8 * (len(samples) + len(index["parts"]))
    assert index["bytes_per_token"] == 4 * 32 * 2 + 5
    assert tensor_bytes <= index["bytes"] <= tensor_bytes * 1.01


@pytest.mark.parametrize("compress", [{}, {"compress": "zstd", "compress_level": 3}], ids=["plain", "zstd"])
def test_resume_keeps_complete_parts_byte_identical(tmp_path, capture, monkeypatch, compress):
    samples = make_samples(20, seed=9)
    settings = {**SETTINGS, "shard_bytes": 20_000, **compress}
    reference = capture_shard(samples, tmp_path / "ref", capture, settings)
    assert len(reference["parts"]) >= 3

    calls = {"n": 0}
    real_write = hidden.write_part

    def dies_on_second_part(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("killed")
        return real_write(*args, **kwargs)

    monkeypatch.setattr(hidden, "write_part", dies_on_second_part)
    with pytest.raises(KeyboardInterrupt):
        capture_shard(samples, tmp_path / "out", capture, settings)
    assert not (tmp_path / "out").exists()  # nothing that looks finished
    first_part = reference["parts"][0]["file"]
    first = (tmp_path / ".out.partial" / first_part).stat().st_mtime_ns
    monkeypatch.setattr(hidden, "write_part", real_write)
    resumed = capture_shard(samples, tmp_path / "out", capture, settings)
    assert (tmp_path / "out" / first_part).stat().st_mtime_ns == first  # kept, not rewritten
    assert resumed["parts"] == reference["parts"]
    for part in reference["parts"]:
        assert (tmp_path / "out" / part["file"]).read_bytes() == (tmp_path / "ref" / part["file"]).read_bytes()
    assert json.loads((tmp_path / "out" / "index.json").read_text())["samples"] == 20


def test_part_layout_matches_the_contract(tmp_path, capture):
    samples = make_samples(4)
    index = capture_shard(samples, tmp_path / "s", capture, {**SETTINGS, "dtype": "bfloat16"})
    with safe_open(str(tmp_path / "s" / index["parts"][0]["file"]), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    total = sum(len(s["input_ids"]) for s in samples)
    assert t["input_ids"].dtype == torch.int32 and t["input_ids"].shape == (total,)
    assert t["loss_mask"].dtype == torch.uint8 and t["loss_mask"].shape == (total,)
    assert t["aux_hidden_states"].dtype == torch.bfloat16 and t["aux_hidden_states"].shape == (total, 3 * 32)
    assert t["hidden_states"].shape == (total, 32)
    assert t["offsets"].tolist() == [0, *torch.cumsum(torch.tensor([len(s["input_ids"]) for s in samples]), 0).tolist()]


def test_nonfinite_states_fail_past_the_threshold(tmp_path, capture, monkeypatch):
    samples = make_samples(4)

    def poisoned(batch):
        out = capture(batch)
        return [(aux * float("nan"), final) for aux, final in out]

    poisoned.model_name, poisoned.num_layers, poisoned.hidden_size = "m", 8, 32
    poisoned.aux_layers, poisoned.final = [2, 4, 5], "normed"
    poisoned.ranks, poisoned.packed = capture.ranks, capture.packed
    with pytest.raises(FloatingPointError, match="4 of 4 samples have NaN/Inf"):
        capture_shard(samples, tmp_path / "nan", poisoned, SETTINGS)
    index = capture_shard(samples, tmp_path / "ok", poisoned, {**SETTINGS, "max_nonfinite_fraction": 1.0})
    assert index["nonfinite_ids"] == ["s0", "s1", "s2", "s3"]


def test_zstd_parts_read_back_equal_and_report_their_ratio(tmp_path, capture):
    samples = make_samples(30, seed=11, lo=10, hi=80)
    settings = {**SETTINGS, "dtype": "bfloat16", "shard_bytes": 40_000}
    plain = capture_shard(samples, tmp_path / "plain", capture, settings)
    packed = capture_shard(samples, tmp_path / "zstd", capture, {**settings, "compress": "zstd", "compress_level": 9})
    assert packed["compress"] == {"codec": "zstd", "level": 9} and plain["compress"] is None
    assert all(p["file"].endswith(".safetensors.zst") for p in packed["parts"])
    assert packed["raw_bytes"] == plain["bytes"] and packed["bytes"] < packed["raw_bytes"]
    a, b = HiddenShard(tmp_path / "plain"), HiddenShard(tmp_path / "zstd")
    for x, y in zip(a, b, strict=True):
        assert x["id"] == y["id"] and all(torch.equal(x[k], y[k]) for k in hidden.COLUMNS)
    assert torch.equal(a["s17"]["hidden_states"], b["s17"]["hidden_states"])


def test_parts_of_an_earlier_plan_do_not_ship(tmp_path, capture, monkeypatch):
    samples = make_samples(12, seed=3)
    work = tmp_path / ".out.partial"
    work.mkdir()
    (work / "part-00007.safetensors").write_bytes(b"left by a run with another shard_bytes")
    index = capture_shard(samples, tmp_path / "out", capture, SETTINGS)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        [*(p["file"] for p in index["parts"]), "index.json"]
    )
