"""A finished shard's `.finished` copy (stages/hidden/finished.py): a job Snakemake forces again links it back
only while what shaped the states is unchanged and its parts match index.json."""

import json

from eagle3_datagen.formats.checksums import ALGORITHM, file_digest
from eagle3_datagen.formats.hidden_shard import release_parts
from eagle3_datagen.formats.released import finished_copy
from eagle3_datagen.stages.hidden.finished import keep_finished, restore_finished, states_fingerprint

SETTINGS = {"hidden_states": {"dtype": "bfloat16", "compress": "zstd_planes"}, "model": {"path": "m"}}


def _shard(tmp_path):
    """A finished shard as the capture writes it: two parts, index.json with their checksums."""
    shard = tmp_path / "hidden/00000"
    shard.mkdir(parents=True)
    parts = []
    for number, size in enumerate((3000, 1000)):
        part = shard / f"part-{number:05d}.safetensors.zst"
        part.write_bytes(bytes(range(256)) * (size // 256) + bytes(size % 256))
        parts.append({"file": part.name, ALGORITHM: file_digest(part), "bytes": size})
    (shard / "index.json").write_text(json.dumps({"parts": parts, "tokens": 40, "bytes": 4000}))
    return shard


def test_a_forced_rerun_links_a_finished_shard_back_and_what_shapes_the_states_decides(tmp_path):
    shard = _shard(tmp_path)
    tokens = tmp_path / "00000.jsonl.zst"
    tokens.write_bytes(b"tokens of the shard")
    fingerprint = states_fingerprint(SETTINGS, tokens)
    copy = keep_finished(shard, fingerprint)
    assert copy == tmp_path / "hidden/.00000.finished"
    assert (copy / "part-00000.safetensors.zst").stat().st_ino == (shard / "part-00000.safetensors.zst").stat().st_ino
    files = {p.name: p.read_bytes() for p in shard.iterdir()}
    for path in shard.iterdir():  # what Snakemake does before it runs a forced job
        path.unlink()
    shard.rmdir()
    assert restore_finished(shard, fingerprint)
    assert {p.name: p.read_bytes() for p in shard.iterdir()} == files

    # another dtype, or other tokens: captured again
    other = {**SETTINGS, "hidden_states": {**SETTINGS["hidden_states"], "dtype": "float8_e4m3fn"}}
    assert states_fingerprint(other, tokens) != fingerprint
    tokens.write_bytes(b"tokens of the shard, answered again")
    assert states_fingerprint(SETTINGS, tokens) != fingerprint
    assert not restore_finished(tmp_path / "hidden/00000", states_fingerprint(SETTINGS, tokens))

    # a part damaged since: captured again
    (copy / "part-00001.safetensors.zst").write_bytes(b"\0" * 1000)
    assert not restore_finished(shard, fingerprint)


def test_the_release_removes_the_finished_copy_with_the_parts(tmp_path):
    shard = _shard(tmp_path)
    keep_finished(shard, "f")
    freed = release_parts(shard, ["results/p/export/specforge"], probe={"verdict": "ok"})
    assert freed == 4000 and not finished_copy(shard).exists()
    assert sorted(p.name for p in shard.iterdir()) == ["index.json", "released.json"]
    assert json.loads((shard / "released.json").read_text())["probe"] == {"verdict": "ok"}
