"""A released partition's exports rebuilt from their kept copy (stages/export/kept.py): byte for byte the
rows a fresh export writes, no byte of the states copied where nothing changed, and refused (NeedsStates)
where the kept copy holds other samples."""

import gzip
import json
import shutil

import pytest

from eagle3_datagen.backends.hf.capture import HFCapture
from eagle3_datagen.formats.hidden_shard import release_parts
from eagle3_datagen.stages.export import export
from eagle3_datagen.stages.export.kept import NeedsStates, keep, rebuild
from eagle3_datagen.stages.hidden.shard import capture_shard
from tests.helpers import HIDDEN_SETTINGS as SETTINGS
from tests.helpers import make_samples

GZIP = {"specforge": {"compress": "gzip", "compress_level": 6}}


def test_exports_rebuilt_from_the_kept_copy_are_the_exports_the_states_give(tmp_path, tiny_model_dir):
    results = tmp_path / "results"
    shard = results / "p/hidden/00000"
    capture = HFCapture(tiny_model_dir, "auto", "raw", {"dtype": "float32", "device": "cpu"})
    samples = make_samples(6, seed=3)
    capture_shard(samples, shard, capture, {**SETTINGS, "dtype": "bfloat16"})
    exports = {fmt: results / "p/export" / fmt for fmt in ("specforge", "speculators")}
    for fmt, out in exports.items():
        export([shard], out, fmt, model_path=tiny_model_dir)
    # what a fresh export of the gzipped rows writes, before the states go
    export([shard], tmp_path / "gzipped", "specforge", model_path=tiny_model_dir, settings=GZIP)
    kept = {fmt: keep(out) for fmt, out in exports.items()}
    assert kept["specforge"] == results / "p/hidden/kept/specforge"
    release_parts(shard, [str(out) for out in exports.values()])
    plain = json.loads((exports["specforge"] / "export.json").read_text())
    speculators = json.loads((exports["speculators"] / "export.json").read_text())
    for out in exports.values():
        shutil.rmtree(out)  # what Snakemake does before the export job

    summary = rebuild(
        kept["specforge"], [shard], exports["specforge"], "specforge", model_path=tiny_model_dir, settings=GZIP
    )
    fresh = json.loads((tmp_path / "gzipped/export.json").read_text())
    rows = {k: v for k, v in fresh["files"].items() if k.startswith("rows_")}
    assert rows and {k: v for k, v in summary.items() if k == "rows"} == {"rows": fresh["rows"]}
    rebuilt = json.loads((exports["specforge"] / "export.json").read_text())
    assert {k: v for k, v in rebuilt["files"].items() if k.startswith("rows_")} == rows
    for name in rows:
        assert (
            gzip.decompress((exports["specforge"] / name).read_bytes())
            == (kept["specforge"] / name.removesuffix(".gz")).read_bytes()
        )
    assert rebuilt["samples"] == plain["samples"] == 6 and rebuilt["rebuilt_from"] == str(kept["specforge"])

    rebuild(kept["speculators"], [shard], exports["speculators"], "speculators", model_path=tiny_model_dir)
    again = json.loads((exports["speculators"] / "export.json").read_text())
    assert again["files"] == speculators["files"]
    states = exports["speculators"] / "hidden_states/hs_0.safetensors"
    assert states.stat().st_ino == (kept["speculators"] / "hidden_states/hs_0.safetensors").stat().st_ino

    with pytest.raises(NeedsStates, match="holds other ones"):
        rebuild(kept["speculators"], [shard], tmp_path / "held", "speculators", held_out={samples[0]["id"]})
