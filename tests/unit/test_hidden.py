import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from eagle3_datagen.backends.base import CaptureBackend, Ranks
from eagle3_datagen.backends.batching import plan_batches
from eagle3_datagen.backends.hf.capture import HFCapture
from eagle3_datagen.formats.hidden_codec import Codec, byte_planes, dequantize, from_byte_planes, quantize
from eagle3_datagen.formats.hidden_shard import COLUMNS, HiddenShard, plan_parts, resolve_aux_layers
from eagle3_datagen.stages.hidden import shard
from eagle3_datagen.stages.hidden.shard import capture_shard
from tests.helpers import HIDDEN_SETTINGS as SETTINGS
from tests.helpers import make_samples


@pytest.fixture(scope="module")
def capture(tiny_model_dir):
    return HFCapture(tiny_model_dir, "auto", "normed", {"dtype": "float32", "device": "cpu"})


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
    raw = HFCapture(tiny_model_dir, [1, 3], "raw", {"dtype": "float32", "device": "cpu"})
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


STORAGE = {
    "plain": {},
    "zstd": {"compress": "zstd", "compress_level": 3},
    "bf16-planes": {"dtype": "bfloat16", "compress": "zstd_planes"},
    "e4m3-token": {"dtype": "float8_e4m3", "scales": "token"},
    "e4m3-channel-zstd": {"dtype": "float8_e4m3", "scales": "channel", "compress": "zstd"},
    "e5m2-block": {"dtype": "float8_e5m2", "scales": "block", "scale_block": 16},
}


def killed_while_writing_the_second_part(samples, out, capture, settings, monkeypatch):
    """A capture job killed once its first part is written (the real writer is back afterwards)."""
    real_write = shard.write_part
    calls = {"n": 0}

    def dies_on_second_part(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("killed")
        return real_write(*args, **kwargs)

    monkeypatch.setattr(shard, "write_part", dies_on_second_part)
    with pytest.raises(KeyboardInterrupt):
        capture_shard(samples, out, capture, settings)
    monkeypatch.setattr(shard, "write_part", real_write)


@pytest.mark.parametrize("compress", STORAGE.values(), ids=STORAGE.keys())
def test_resume_keeps_complete_parts_byte_identical(tmp_path, capture, monkeypatch, compress):
    samples = make_samples(20, seed=9)
    settings = {**SETTINGS, "shard_bytes": 20_000, **compress}
    reference = capture_shard(samples, tmp_path / "ref", capture, settings)
    assert len(reference["parts"]) >= 3

    killed_while_writing_the_second_part(samples, tmp_path / "out", capture, settings, monkeypatch)
    assert not (tmp_path / "out").exists()  # nothing that looks finished
    first_part = reference["parts"][0]["file"]
    first = (tmp_path / ".out.partial" / first_part).stat().st_mtime_ns
    resumed = capture_shard(samples, tmp_path / "out", capture, settings)
    assert (tmp_path / "out" / first_part).stat().st_mtime_ns == first  # kept, not rewritten
    assert resumed["parts"] == reference["parts"]
    for part in reference["parts"]:
        assert (tmp_path / "out" / part["file"]).read_bytes() == (tmp_path / "ref" / part["file"]).read_bytes()
    assert json.loads((tmp_path / "out" / "index.json").read_text())["samples"] == 20


def test_resume_recomputes_a_part_damaged_while_no_job_ran(tmp_path, capture, monkeypatch):
    samples = make_samples(12, seed=5)
    settings = {**SETTINGS, "shard_bytes": 20_000}
    reference = capture_shard(samples, tmp_path / "ref", capture, settings)
    killed_while_writing_the_second_part(samples, tmp_path / "out", capture, settings, monkeypatch)
    first = tmp_path / ".out.partial" / reference["parts"][0]["file"]
    data = bytearray(first.read_bytes())
    data[-100] ^= 0xFF  # one bit pattern flipped in the last layer's rows, header intact
    first.write_bytes(bytes(data))
    resumed = capture_shard(samples, tmp_path / "out", capture, settings)
    assert resumed["parts"] == reference["parts"]  # the damaged part recomputed, checksums as written
    assert (tmp_path / "out" / first.name).read_bytes() == (tmp_path / "ref" / first.name).read_bytes()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        [p["file"] for p in reference["parts"]] + ["index.json"]
    )  # no checksum files left beside the parts


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


class PoisonedCapture:
    """A `CaptureBackend` that returns another capture's states with NaN auxiliary layers."""

    def __init__(self, capture: CaptureBackend):
        self.capture = capture
        self.packed, self.ranks = capture.packed, capture.ranks
        self.model_name, self.num_layers, self.hidden_size = capture.model_name, capture.num_layers, capture.hidden_size
        self.aux_layers, self.final, self.model = capture.aux_layers, capture.final, capture.model

    def __call__(self, batch):
        return [(aux * float("nan"), final) for aux, final in self.capture(batch)]


def test_captures_are_capture_backends(capture):
    assert isinstance(capture, CaptureBackend) and isinstance(capture.ranks, Ranks)
    assert isinstance(PoisonedCapture(capture), CaptureBackend)


def test_nonfinite_states_fail_past_the_threshold(tmp_path, capture, monkeypatch):
    samples = make_samples(4)
    poisoned = PoisonedCapture(capture)
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
        assert x["id"] == y["id"] and all(torch.equal(x[k], y[k]) for k in COLUMNS)
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


def test_byte_planes_restore_identical_bits():
    bits = torch.randint(-(1 << 15), 1 << 15, (37, 24), dtype=torch.int16)
    bits[0, :4] = torch.tensor([0x7F80, 0x7FC1, -32768, 0x0001], dtype=torch.int16)  # inf, NaN, -0, subnormal
    values = bits.view(torch.bfloat16)
    planes = byte_planes(values)
    assert planes.shape == (2, 37, 24) and planes.dtype == torch.uint8
    assert torch.equal(planes[1], (bits >> 8).to(torch.uint8))  # the high byte: sign, exponent, 1 mantissa bit
    assert torch.equal(from_byte_planes(planes, torch.bfloat16).view(torch.int16), bits)
    wide = torch.randn(5, 8)
    assert torch.equal(from_byte_planes(byte_planes(wide), torch.float32).view(torch.int32), wide.view(torch.int32))


def _relative_error(restored: torch.Tensor, states: torch.Tensor, columns) -> float:
    return float((restored.float() - states)[:, columns].norm() / states[:, columns].norm())


@pytest.mark.parametrize("granularity", ["token", "channel", "block"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_scales_are_powers_of_two_and_errors_stay_within_fp8_precision(granularity, dtype):
    torch.manual_seed(0)
    states = torch.randn(50, 3 * 32) * torch.logspace(-1, 1, 50)[:, None]  # tokens 100x apart
    states[:, 5] *= 1000.0  # a massive-activation channel in the first layer
    values, scales = quantize(states, 3, dtype, granularity, scale_block=16)
    expected = {"token": (50, 3), "channel": (96,), "block": (50, 6)}[granularity]
    assert values.dtype == dtype and tuple(scales.shape) == expected
    assert torch.equal(torch.exp2(torch.log2(scales.float()).round()), scales.float())
    restored = dequantize(values, scales)
    assert restored.dtype == torch.bfloat16
    # Power-of-two scales leave fp8's relative precision as it is: within its range, every
    # granularity gives the same error, about 2^-(mantissa bits) / sqrt(12) x 2.
    bound = 0.04 if dtype == torch.float8_e4m3fn else 0.08
    for layer in range(3):
        assert _relative_error(restored, states, slice(layer * 32, (layer + 1) * 32)) <= bound


def test_per_token_scales_lose_a_row_to_an_outlier_beyond_fp8_range():
    torch.manual_seed(0)
    states = torch.randn(20, 2 * 32)
    states[:, 5] *= 1e6  # past e4m3's range (448 down to 2^-9): the rest of its row underflows
    rest = [c for c in range(32) if c != 5]
    errors = {}
    for granularity in ("token", "channel", "block"):
        values, scales = quantize(states, 2, torch.float8_e4m3fn, granularity, scale_block=16)
        errors[granularity] = _relative_error(dequantize(values, scales), states, rest)
    assert errors["token"] > 0.5 and errors["channel"] < 0.04
    assert 0.04 < errors["block"] < errors["token"]  # only the outlier's block of 16 is lost


def test_fp8_shard_reads_back_bf16_near_the_plain_states_with_reference_rows(tmp_path, capture):
    samples = make_samples(12, seed=2, lo=10, hi=60)
    settings = {**SETTINGS, "dtype": "bfloat16", "shard_bytes": 20_000}
    plain = capture_shard(samples, tmp_path / "bf16", capture, settings)
    fp8 = {**settings, "dtype": "float8_e4m3", "scales": "channel", "reference_positions": 40}
    index = capture_shard(samples, tmp_path / "fp8", capture, fp8)
    assert index["dtype"] == "float8_e4m3" and index["scales"] == {"granularity": "channel", "dtype": "bfloat16"}
    assert index["bytes_per_token"] == 4 * 32 + 5
    a, b = HiddenShard(tmp_path / "bf16"), HiddenShard(tmp_path / "fp8")
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x["input_ids"], y["input_ids"]) and y["hidden_states"].dtype == torch.bfloat16
        for name in ("aux_hidden_states", "hidden_states"):
            # e4m3 keeps 3 mantissa bits; values far below their channel's largest fall to subnormals
            torch.testing.assert_close(y[name].float(), x[name].float(), atol=1e-3, rtol=2**-4)
    references = list(b.references())
    assert len(references) == len(index["parts"]) and not list(a.references())
    rows = sum(len(r["targets"]) for r in references)
    assert 40 <= rows <= 40 + len(index["parts"])  # each part's share, rounded up
    assert index["bytes"] - rows * (4 * 32 * 2 + 8) < 0.6 * plain["bytes"]  # fp8 values besides the bf16 rows
    # The reference rows are the bf16 states the plain shard stores, at rows predicting loss tokens.
    plain_rows = {name: torch.cat([x[name] for x in a]) for name in ("input_ids", "loss_mask", "aux_hidden_states")}
    start = 0
    for part, reference in zip(index["parts"], references, strict=True):
        with safe_open(str(tmp_path / "fp8" / part["file"]), "pt") as f:
            rows = start + f.get_tensor("reference_rows")
        assert plain_rows["loss_mask"][rows + 1].all()
        assert torch.equal(reference["targets"], plain_rows["input_ids"][rows + 1].long())
        assert torch.equal(reference["reference"]["aux_hidden_states"], plain_rows["aux_hidden_states"][rows])
        start += part["tokens"]


def test_lossless_settings_are_bit_exact(tmp_path, capture):
    samples = make_samples(10, seed=6, lo=10, hi=60)
    settings = {**SETTINGS, "dtype": "bfloat16", "shard_bytes": 20_000}
    capture_shard(samples, tmp_path / "plain", capture, settings)
    index = capture_shard(samples, tmp_path / "planes", capture, {**settings, "compress": "zstd_planes"})
    assert index["compress"] == {"codec": "zstd_planes", "level": 3} and index["bytes"] < index["raw_bytes"]
    for x, y in zip(HiddenShard(tmp_path / "plain"), HiddenShard(tmp_path / "planes"), strict=True):
        for name in COLUMNS:
            assert x[name].dtype == y[name].dtype and torch.equal(x[name].view(torch.uint8), y[name].view(torch.uint8))


def test_codec_rejects_unknown_settings():
    with pytest.raises(ValueError, match="hidden_states.dtype 'float8'"):
        Codec.from_settings({**SETTINGS, "dtype": "float8"})
    with pytest.raises(ValueError, match="scale_block 48 must divide the hidden size 64"):
        Codec.from_settings({**SETTINGS, "dtype": "float8_e4m3", "scales": "block", "scale_block": 48}).bytes_per_token(
            3, 64
        )


def test_plan_and_report_count_bytes_with_the_stored_dtype_and_ratio(tmp_path):
    from eagle3_datagen.formats.storage import SHARD_RATIOS
    from eagle3_datagen.reporting.report import storage_summary
    from eagle3_datagen.workflow.disk import observed_shard_ratio

    codec = Codec.from_settings({**SETTINGS, "dtype": "float8_e4m3", "scales": "token", "compress": "zstd"})
    assert codec.bytes_per_token(3, 7168) == 4 * 7168 + 4 * 2 + 5  # Kimi-K2.5: half of bf16's 57,349
    bf16 = {**SETTINGS, "dtype": "bfloat16"}
    assert Codec.from_settings(bf16).bytes_per_token(3, 7168) == 57_349
    assert observed_shard_ratio(tmp_path, "bfloat16", "zstd_planes", 3) == (SHARD_RATIOS[("zstd_planes", 3)], "assumed")
    assert observed_shard_ratio(tmp_path, "bfloat16", "zstd_planes", 1) == (SHARD_RATIOS[("zstd_planes", 1)], "assumed")
    indexes = [
        {"dtype": "float8_e4m3", "compress": {"codec": "zstd", "level": 3}, "bytes": 300, "raw_bytes": 400},
        {"dtype": "float8_e4m3", "compress": {"codec": "zstd", "level": 3}, "bytes": 500, "raw_bytes": 600},
        {"dtype": "bfloat16", "compress": {"codec": "zstd", "level": 3}, "bytes": 10, "raw_bytes": 1000},
        {"dtype": "float8_e4m3", "compress": {"codec": "zstd", "level": 9}, "bytes": 1, "raw_bytes": 1000},
    ]
    for n, index in enumerate(indexes):
        (tmp_path / f"P{n}" / "hidden" / "00000").mkdir(parents=True)
        (tmp_path / f"P{n}" / "hidden" / "00000" / "index.json").write_text(json.dumps(index))
    assert observed_shard_ratio(tmp_path, "float8_e4m3", "zstd", 3) == (0.8, "observed on finished shards")
    shards = [{**indexes[0], "tokens": 10, "aux_layers": [2, 4, 5], "hidden_size": 8, "scales": None}]
    summary = storage_summary(shards)
    assert summary["bytes_per_token"] == 30.0 and summary["ratio_to_bf16"] == 300 / (10 * (4 * 8 * 2 + 5))
    assert summary["compress"] == "zstd" and summary["dtype"] == "float8_e4m3"
