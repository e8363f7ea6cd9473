"""Exporters and the vocabulary mapping, read back as SpecForge and vLLM speculators read them."""

import inspect
import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from eagle3_datagen import config_schema
from eagle3_datagen.backends.hf.capture import HFCapture
from eagle3_datagen.formats.checkpoint import FinalNorm
from eagle3_datagen.formats.checksums import ChecksumError, file_digest
from eagle3_datagen.formats.files import write_jsonl_zst
from eagle3_datagen.formats.hidden_codec import COMPRESS, FP8_DTYPES, GRANULARITIES, frame_header_json
from eagle3_datagen.formats.hidden_shard import HiddenShard
from eagle3_datagen.formats.holdout import choose_holdout, read_holdout, write_holdout
from eagle3_datagen.formats.trainer_exports import EXPORTS
from eagle3_datagen.stages.evaluate.draft import train_config
from eagle3_datagen.stages.export import export
from eagle3_datagen.stages.export.exporter import Exporter
from eagle3_datagen.stages.export.specforge import specforge_sample_path
from eagle3_datagen.stages.hidden.shard import capture_shard
from eagle3_datagen.stages.probe import LMHead, probe_shard
from eagle3_datagen.stages.vocab import loss_token_counts, run_vocab, vocab_mapping
from tests.helpers import HIDDEN_SETTINGS as SETTINGS
from tests.helpers import REPO, make_samples, probe_settings

STORAGE = {
    "bf16": {"dtype": "bfloat16"},
    "bf16-planes": {"dtype": "bfloat16", "compress": "zstd_planes"},
    "e4m3-block-zstd": {"dtype": "float8_e4m3", "scales": "block", "scale_block": 16, "compress": "zstd"},
    "e5m2-channel": {"dtype": "float8_e5m2", "scales": "channel"},
}


@pytest.fixture(scope="module", params=STORAGE.values(), ids=STORAGE.keys())
def shards(request, tmp_path_factory, tiny_model_dir):
    """Two shards of 7 and 5 samples of mixed lengths, stored with each setting."""
    root = tmp_path_factory.mktemp("shards")
    capture = HFCapture(tiny_model_dir, "auto", "raw", {"dtype": "float32", "device": "cpu"})
    samples = make_samples(12, seed=4)
    dirs = [root / "00000", root / "00001"]
    capture_shard(samples[:7], dirs[0], capture, {**SETTINGS, **request.param, "shard_bytes": 8_000})
    capture_shard(samples[7:], dirs[1], capture, {**SETTINGS, **request.param})
    return dirs


def stored(shards):
    return [s for d in shards for s in HiddenShard(d)]


def speculators_states(data: dict) -> torch.Tensor:
    """An exported sample's states as speculators 0.9.0 reads them: fp8 dequantized as hs_connectors 0.9.0's
    FP8Transfer does (tests/trainers/test_speculators.py runs the real one)."""
    if "hidden_states_scales" not in data:
        return data["hidden_states"]
    return data["hidden_states"].to(torch.bfloat16) * data["hidden_states_scales"].to(torch.bfloat16)


def test_specforge_layout_round_trips(tmp_path, shards, tiny_model_dir):
    summary = export(shards, tmp_path / "sf", "specforge", model_path=tiny_model_dir)
    assert summary["samples"] == 12 and summary["final_norm_applied"] is True  # raw shards: normed on export
    final_norm = FinalNorm(tiny_model_dir)
    ids = [json.loads(line) for line in (tmp_path / "sf" / "ids.jsonl").read_text().splitlines()]
    for index, sample in enumerate(stored(shards)):
        # as SpecForge's offline dataset loads a sample
        path = tmp_path / "sf" / specforge_sample_path(index)
        assert path.relative_to(tmp_path / "sf").as_posix() == f"rows_000000000-000001000/data_{index:09d}.ckpt"
        data = torch.load(path, weights_only=True)
        length = len(sample["input_ids"])
        assert data["input_ids"].shape == data["loss_mask"].shape == (length,)
        assert data["hidden_state"].shape == (1, length, 32) and data["aux_hidden_state"].shape == (1, length, 96)
        assert data["hidden_state"].dtype == data["aux_hidden_state"].dtype == torch.bfloat16  # fp8 dequantized
        assert torch.equal(data["input_ids"], sample["input_ids"].long())
        assert torch.equal(data["loss_mask"], sample["loss_mask"].long())
        assert torch.equal(data["hidden_state"][0], final_norm(sample["hidden_states"]))
        assert torch.equal(data["aux_hidden_state"][0], sample["aux_hidden_states"])
        assert ids[index] == {"index": index, "id": sample["id"]}
        # only the sample's own rows are saved (torch.save of a view writes its whole part)
        assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in data.values())


def test_specforge_export_norms_raw_final_states_and_carries_its_config(tmp_path, tiny_model_dir):
    capture = HFCapture(tiny_model_dir, "auto", "raw", {"dtype": "float32", "device": "cpu"})
    capture_shard(make_samples(5, seed=6), tmp_path / "raw", capture, {**SETTINGS, "dtype": "bfloat16"})
    run_vocab_from_samples(tmp_path, tiny_model_dir)
    vocab = tmp_path / "vocab"
    summary = export(
        [tmp_path / "raw"], tmp_path / "sf", "specforge", model_path=tiny_model_dir, vocab_dir=vocab, draft_vocab_size=8
    )
    assert summary["final_norm_applied"] is True and summary["specforge_aux_layer_ids"] == [1, 3, 4]
    weight = load_file(tiny_model_dir / "model.safetensors")["model.norm.weight"].float()
    for index, sample in enumerate(HiddenShard(tmp_path / "raw")):
        data = torch.load(tmp_path / "sf" / specforge_sample_path(index), weights_only=True)
        h = sample["hidden_states"].float()
        normed = (weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
        assert torch.equal(data["hidden_state"][0], normed)
    assert not (tmp_path / "sf" / "vocab_mapping.pt").exists()  # named, not copied: results/vocab's own
    mapping = torch.load(tmp_path / "vocab" / "vocab_mapping.pt", weights_only=True)
    assert mapping["d2t"].tolist() == np.load(tmp_path / "vocab" / "d2t.npy").tolist()
    assert (
        mapping["t2d"].dtype == torch.bool
        and mapping["t2d"].tolist() == np.load(tmp_path / "vocab" / "t2d.npy").tolist()
    )
    draft = json.loads((tmp_path / "sf" / "draft_config.json").read_text())
    assert draft["draft_vocab_size"] == 8 and draft["vocab_size"] == 512 and draft["hidden_size"] == 32
    assert draft["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}
    train = yaml.safe_load((tmp_path / "sf" / "specforge.yaml").read_text())
    assert train["model"]["lm_head_key"] == "lm_head.weight"  # the tiny model's head is untied
    assert train["model"]["vocab_mapping_path"] == str(vocab.resolve() / "vocab_mapping.pt")
    assert train["data"]["hidden_states_path"] == str((tmp_path / "sf").resolve())
    readme = (tmp_path / "sf" / "README.md").read_text()
    assert f"specforge train --config {(tmp_path / 'sf').resolve()}/specforge.yaml" in readme
    assert "has no `*.index.json`" in readme  # the tiny model is one model.safetensors


def test_a_copied_work_directorys_export_trains_on_the_copys_files(tmp_path, tiny_model_dir):
    """The evaluate stage reads an export's `specforge.yaml` where the export now is: in a copy of the work
    directory, its samples, draft config and draft vocabulary are the copy's; the target, outside the
    work directory, stays where it was written. A partition's draft trains with its own vocabulary."""
    work = tmp_path / "wf"
    capture = HFCapture(tiny_model_dir, "auto", "raw", {"dtype": "float32", "device": "cpu"})
    capture_shard(make_samples(3, seed=6), work / "results/p/hidden/00000", capture, SETTINGS)
    run_vocab_from_samples(work / "results", tiny_model_dir)
    sf = Path("results/p/export/specforge")
    export([work / "results/p/hidden/00000"], work / sf, "specforge", model_path=tiny_model_dir,
           vocab_dir=work / "results/vocab", draft_vocab_size=8)  # fmt: skip
    written = yaml.safe_load((work / sf / "specforge.yaml").read_text())
    assert train_config(work / sf) == written  # where it was written: as written

    copy = shutil.copytree(work, tmp_path / "elsewhere" / "wf").resolve()
    config = train_config(copy / sf)
    assert config["data"]["hidden_states_path"] == str(copy / sf)
    assert config["model"] == {
        **written["model"],
        "draft_model_config": str(copy / sf / "draft_config.json"),
        "vocab_mapping_path": str(copy / "results/vocab/vocab_mapping.pt"),
    }
    assert config["model"]["target_model_path"] == str(tiny_model_dir)
    # a partition's own draft vocabulary (evaluate_vocab) in place of the one the export names
    own = copy / "results/p/evaluate/vocab"
    own_config = train_config(copy / sf, own)["model"]
    assert own_config == {**config["model"], "vocab_mapping_path": str(own / "vocab_mapping.pt")}


def run_vocab_from_samples(tmp_path, model_dir):
    path = tmp_path / "tokens.jsonl.zst"
    write_jsonl_zst(path, make_samples(5, seed=6))
    run_vocab([str(path)], model_dir, 8, tmp_path / "vocab")


def test_specforge_export_refuses_other_than_three_aux_layers(tmp_path, tiny_model_dir):
    capture = HFCapture(tiny_model_dir, [2, 5], "raw", {"dtype": "float32", "device": "cpu"})
    capture_shard(make_samples(2), tmp_path / "two", capture, SETTINGS)
    with pytest.raises(ValueError, match="exactly 3 auxiliary layers"):
        export([tmp_path / "two"], tmp_path / "sf", "specforge", model_path=tiny_model_dir)
    assert not (tmp_path / "sf").exists()


def test_speculators_layout_round_trips(tmp_path, shards, tiny_model_dir):
    import datasets

    vocab = tmp_path / "vocab"
    vocab.mkdir()
    np.save(vocab / "d2t.npy", np.array([3, 3, 5]))
    np.save(vocab / "t2d.npy", np.isin(np.arange(512), [3, 4, 7]))
    summary = export(
        shards, tmp_path / "sp", "speculators", model_path=tiny_model_dir, vocab_dir=vocab, draft_vocab_size=3
    )
    assert summary["final"] == "raw" and summary["final_norm_applied"] is False
    rows = datasets.load_from_disk(str(tmp_path / "sp"))  # speculators' ArrowDataset: the same call
    assert rows.format["type"] == "torch" and len(rows) == 12
    codec = HiddenShard(shards[0]).codec
    kept_fp8 = codec.fp8 and codec.scales in ("token", "channel")  # speculators' fp8 backend reads these
    assert summary["dtype"] == (codec.dtype if kept_fp8 or not codec.fp8 else "bfloat16")
    assert ("--hidden-states-backend fp8" in summary["command"]) == kept_fp8
    for index, sample in enumerate(stored(shards)):
        data = load_file(tmp_path / "sp" / "hidden_states" / f"hs_{index}.safetensors")
        length = len(sample["input_ids"])
        assert data["hidden_states"].shape == (length, 4, 32)  # 3 auxiliary layers, then the final one
        assert torch.equal(data["token_ids"], sample["input_ids"].long())
        if kept_fp8:
            assert data["hidden_states"].dtype == FP8_DTYPES[codec.dtype]
            assert data["hidden_states_scales"].dtype == torch.float32
        states = speculators_states(data)
        assert torch.equal(states[:, -1], sample["hidden_states"])
        # speculators' auxiliary input: every layer but the last, flattened
        assert torch.equal(states[:, :-1].flatten(1), sample["aux_hidden_states"])
        assert torch.equal(rows[index]["input_ids"], sample["input_ids"].long())
        assert torch.equal(rows[index]["loss_mask"], sample["loss_mask"].long())
        assert int(rows[index]["seq_len"]) == length
    written = json.loads((tmp_path / "sp" / "export.json").read_text())
    files = written["files"]
    assert {"README.md", "ids.jsonl", "state.json", "hidden_states/hs_11.safetensors"} <= set(files)
    assert all(file_digest(tmp_path / "sp" / name) == value for name, value in files.items())
    command = written["command"]
    assert f"--data-path {tmp_path / 'sp'}" in command and "--target-layer-ids 2 4 5" in command
    assert f"--draft-vocab-size 3 --d2t-path {vocab / 'd2t.npy'} --t2d-path {vocab / 't2d.npy'}" in command
    assert command in (tmp_path / "sp" / "README.md").read_text()


def test_held_out_prompts_are_in_no_export_and_the_counts_add_up(tmp_path, tiny_model_dir):
    """The evaluation's held-out prompts, chosen by id (formats/holdout.py), leave both exports; the rest
    are exported in shard order, and exported plus held out is every captured sample."""
    import datasets

    capture = HFCapture(tiny_model_dir, "auto", "raw", {"dtype": "float32", "device": "cpu"})
    samples = make_samples(8, seed=3, hi=12)
    shard_dirs = [tmp_path / "00000", tmp_path / "00001"]
    capture_shard(samples[:5], shard_dirs[0], capture, SETTINGS)
    capture_shard(samples[5:], shard_dirs[1], capture, SETTINGS)
    ids = [s["id"] for s in samples]
    # one held-out prompt has no sample (its response dropped by the tokens stage)
    write_holdout(tmp_path / "holdout.json", choose_holdout([*ids, "dropped"], 4, seed=0), 9, 4, 0)
    held_out = read_holdout(tmp_path / "holdout.json")
    assert held_out == choose_holdout(reversed([*ids, "dropped"]), 4, seed=0) and len(held_out) == 4
    kept = [s for s in samples if s["id"] not in held_out]
    assert "dropped" in held_out and len(kept) == 5  # 3 of the 8 samples held out
    for fmt in EXPORTS:
        out = tmp_path / fmt
        summary = export(shard_dirs, out, fmt, model_path=tiny_model_dir, held_out=held_out)
        exported = [json.loads(line)["id"] for line in (out / "ids.jsonl").read_text().splitlines()]
        assert exported == [s["id"] for s in kept] and not set(exported) & set(held_out)
        assert summary["samples"] == len(kept) and summary["samples"] + summary["held_out"] == len(samples)
        assert summary["tokens"] == sum(len(s["input_ids"]) for s in kept)
        if fmt == "specforge":
            rows = [torch.load(p)["input_ids"].tolist() for p in sorted(out.glob("rows_*/*.ckpt"))]
        else:
            rows = [r.tolist() for r in datasets.load_from_disk(str(out))["input_ids"]]
        assert rows == [s["input_ids"] for s in kept]


def test_the_holdout_choice_depends_on_ids_and_seed_only():
    ids = [f"p{i}" for i in range(50)]
    chosen = choose_holdout(ids, 5, seed=0)
    assert chosen == choose_holdout(ids[::-1] + ids[:3], 5, seed=0) and len(set(chosen)) == 5
    assert chosen[:3] == choose_holdout(ids, 3, seed=0)  # a smaller holdout is a subset
    assert choose_holdout(ids, 5, seed=1) != chosen
    assert sorted(choose_holdout(ids[:3], 5, seed=0)) == ids[:3]  # fewer prompts than asked: all


def test_speculators_export_refuses_normed_final(tmp_path, tiny_model_dir):
    capture = HFCapture(tiny_model_dir, "auto", "normed", {"dtype": "float32", "device": "cpu"})
    capture_shard(make_samples(3), tmp_path / "normed", capture, SETTINGS)
    with pytest.raises(ValueError, match="norm it twice. Capture with hidden_states.final: raw"):
        export([tmp_path / "normed"], tmp_path / "sp", "speculators")
    assert not (tmp_path / "sp").exists()


def test_vocab_mapping_takes_the_most_trained_tokens():
    counts = np.array([0, 5, 1, 9, 0, 5, 2])
    d2t, t2d = vocab_mapping(counts, 3)
    chosen = np.arange(3) + d2t
    assert chosen.tolist() == [1, 3, 5]  # 9, 5 and 5 (a tie goes to the lower id), in target-id order
    assert t2d.tolist() == [False, True, False, True, False, True, False]
    with pytest.raises(ValueError, match="must be in 1..7"):
        vocab_mapping(counts, 8)


def test_token_counts_only_count_loss_masked_tokens(tmp_path, tiny_model_dir):
    path = tmp_path / "t.jsonl.zst"
    write_jsonl_zst(
        path,
        [
            {"id": "a", "input_ids": [7, 8, 9, 9], "loss_mask": [0, 0, 1, 1]},
            {"id": "b", "input_ids": [9, 3, 3], "loss_mask": [1, 0, 1]},
        ],
    )
    counts = loss_token_counts([path], 512)
    assert counts[9] == 3 and counts[3] == 1 and counts[7] == counts[8] == 0 and counts.sum() == 4
    held_out = loss_token_counts([path], 512, held_out=["b"])  # the evaluation's: not exported, not counted
    assert held_out[9] == 2 and held_out[3] == 0 and held_out.sum() == 2
    summary = run_vocab([str(path)], tiny_model_dir, 1, tmp_path / "vocab")
    assert summary["coverage"] == 0.75 and summary["target_vocab_size"] == 512
    assert np.load(tmp_path / "vocab" / "d2t.npy").tolist() == [9]


PLAIN = {f"{d}-{c}": {"dtype": d, "compress": c} for d in ("bfloat16", "float16", "float32") for c in COMPRESS}
FP8 = {
    f"{d}-{g}-{c}": {"dtype": d, "scales": g, "scale_block": 16, "compress": c}
    for d in FP8_DTYPES
    for g in GRANULARITIES
    for c in COMPRESS
}
MATRIX = {**PLAIN, **FP8}


def test_the_matrix_is_every_setting_the_schema_accepts():
    schema = config_schema.schema()
    hidden = schema["properties"]["hidden_states"]["properties"]
    plain = [d for d in hidden["dtype"]["enum"] if not d.startswith("float8")]
    fp8 = [d for d in hidden["dtype"]["enum"] if d.startswith("float8")]
    expected = len(plain) * len(hidden["compress"]["enum"]) + len(fp8) * len(hidden["scales"]["enum"]) * len(
        hidden["compress"]["enum"]
    )
    assert len(MATRIX) == expected and len(FP8) > 0 and len(PLAIN) > 0


@pytest.fixture(scope="module")
def raw_capture(tiny_model_dir):
    return HFCapture(tiny_model_dir, "auto", "raw", {"dtype": "float32", "device": "cpu"})


@pytest.fixture(scope="module")
def head(tiny_model_dir):
    return LMHead(tiny_model_dir)


@pytest.mark.parametrize("storage", MATRIX.values(), ids=MATRIX.keys())
def test_every_storage_setting_reads_back_through_every_reader(tmp_path, head, raw_capture, storage, tiny_model_dir):
    samples = make_samples(5, seed=2)
    shard_dir = tmp_path / "00000"
    index = capture_shard(samples, shard_dir, raw_capture, {**SETTINGS, **storage, "shard_bytes": 8_000})
    assert len(index["parts"]) > 1 and all(len(p["xxh3_64"]) == 16 for p in index["parts"])
    result = probe_shard(shard_dir, head, probe_settings())
    masked = sum(sum(s["loss_mask"][1:]) for s in samples)  # every loss-masked token after row 0
    assert result["positions_probed"] == result["positions_total"] == masked
    assert (result["storage_cost"] is None) == (storage["dtype"] in ("bfloat16", "float16", "float32"))
    read = list(HiddenShard(shard_dir))
    assert [s["input_ids"].tolist() for s in read] == [s["input_ids"] for s in samples]
    export([shard_dir], tmp_path / "sf", "specforge", model_path=tiny_model_dir)
    export([shard_dir], tmp_path / "sp", "speculators", threads=2)
    for number, sample in enumerate(read):
        sf = torch.load(tmp_path / "sf" / specforge_sample_path(number), weights_only=True)
        sp = speculators_states(load_file(tmp_path / "sp" / "hidden_states" / f"hs_{number}.safetensors"))
        assert torch.equal(sf["aux_hidden_state"][0], sample["aux_hidden_states"])
        assert torch.equal(sp[:, :-1].flatten(1), sample["aux_hidden_states"])
        assert torch.equal(sp[:, -1], sample["hidden_states"])


def _flip_bytes(part: Path, count: int = 64) -> None:
    """Invert `count` bytes inside the auxiliary layers' data (plain part), or mid-file (compressed)."""
    data = bytearray(part.read_bytes())
    if part.suffix == ".zst":
        start = len(data) // 2
    else:
        header = frame_header_json(part)
        start = 8 + struct.unpack("<Q", data[:8])[0] + header["aux_hidden_states"]["data_offsets"][0] + 256
    data[start : start + count] = bytes(b ^ 0xFF for b in data[start : start + count])
    part.write_bytes(bytes(data))


@pytest.mark.parametrize("storage", [{"dtype": "bfloat16"}, {"dtype": "bfloat16", "compress": "zstd_planes"}])
def test_flipped_bytes_in_a_part_stop_every_reader(tmp_path, head, raw_capture, storage, tiny_model_dir):
    shard_dir = tmp_path / "00000"
    index = capture_shard(
        make_samples(6, seed=3), shard_dir, raw_capture, {**SETTINGS, **storage, "shard_bytes": 8_000}
    )
    part = shard_dir / index["parts"][1]["file"]
    _flip_bytes(part)
    refused = rf"{part}: xxh3_64 checksum \w+ does not match .*recapture that shard: `snakemake --forcerun {shard_dir}`"
    with pytest.raises(ChecksumError, match=refused):
        list(HiddenShard(shard_dir))
    with pytest.raises(ChecksumError, match=refused):
        probe_shard(shard_dir, head, probe_settings())
    for fmt in EXPORTS:
        with pytest.raises(ChecksumError, match=refused):
            export([shard_dir], tmp_path / fmt, fmt, model_path=tiny_model_dir)
        assert not (tmp_path / fmt).exists()


def test_config_validation_refuses_what_no_reader_takes(tmp_path):
    from eagle3_datagen.config_schema import fill_defaults
    from eagle3_datagen.workflow.config_checks import storage_problems

    config = fill_defaults(yaml.safe_load((REPO / "config.yaml").read_text()))
    assert storage_problems(config) == []
    normed = {**config, "hidden_states": {**config["hidden_states"], "final": "normed"}}
    normed["export"] = {"formats": ["specforge", "speculators"]}
    assert ["Set hidden_states.final: raw" in p for p in storage_problems(normed)] == [True]
    assert storage_problems({**normed, "export": {"formats": ["specforge"]}}) == []
    block = {**config, "hidden_states": {**config["hidden_states"], "dtype": "float8_e4m3", "scales": "block"}}
    block["hidden_states"]["scale_block"] = 48  # the demo's hidden size is 64
    assert ["does not divide the model's hidden size 64" in p for p in storage_problems(block)] == [True]


@pytest.mark.parametrize("name", EXPORTS.names())
def test_every_export_has_the_exporters_shape(name):
    """Each registered export's class takes what `export.export` passes and answers what it calls."""
    exporter = EXPORTS[name].exporter()
    for method in ("__init__", "add", "finish"):
        ours = inspect.signature(getattr(exporter, method)).parameters
        assert list(ours) == list(inspect.signature(getattr(Exporter, method)).parameters), (name, method)
