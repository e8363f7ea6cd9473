"""A released partition's kept exports: the one copy of its states, and the exports rebuilt from it.

Once a partition's shards are released (hidden_states.keep_shards: false), `keep` links every file of each
of its exports into results/<partition>/hidden/kept/<format>/ (hard links: no byte is copied, the export and
its kept copy are one set of blocks). Snakemake removes an export's directory before the job that remakes
it; the kept copy stays, and `rebuild` writes the export again from it: the files beside the samples
(configs, README, the vocabulary and model they name) written anew as `export.export` writes them, the
sample files linked again, SpecForge's rows gzipped or unzipped where `export.specforge.compress` changed.
The samples must be the kept copy's, in its order: another holdout or another format needs the states
(`NeedsStates`; the preflight refuses such a run first, with its price).
"""

from __future__ import annotations

import gzip
import logging
import os
import shutil
from collections.abc import Collection
from pathlib import Path

import orjson

from eagle3_datagen.formats.checksums import ALGORITHM
from eagle3_datagen.formats.files import atomic_dir, read_json, write_json
from eagle3_datagen.formats.hidden_shard import ShardIndex
from eagle3_datagen.formats.released import kept_export
from eagle3_datagen.formats.trainer_exports import EXPORTS
from eagle3_datagen.stages.export.files import ExportFiles
from eagle3_datagen.stages.export.specforge import specforge_sample_path

log = logging.getLogger(__name__)

EXPORT_RECORD = "export.json"
IDS = "ids.jsonl"


class NeedsStates(ValueError):
    """An export the kept copy cannot give: its states must be captured again."""


def kept_dir(export_dir: str | Path) -> Path:
    """The kept copy of results/<partition>/export/<format> (`released.kept_export`)."""
    export_dir = Path(export_dir)
    return kept_export(export_dir.parent.parent.parent, export_dir.parent.parent.name, export_dir.name)


def keep(export_dir: str | Path) -> Path | None:
    """Link every file of a finished export into its kept copy (`kept_dir`), replacing an older copy; None
    where the filesystem links no files (the export is then the one copy, and remaking it needs the states)."""
    export_dir = Path(export_dir)
    record = read_json(export_dir / EXPORT_RECORD)
    target = kept_dir(export_dir)
    work = target.with_name(f".{target.name}.linking")
    shutil.rmtree(work, ignore_errors=True)
    try:
        for relative in [*record["files"], EXPORT_RECORD]:
            (work / relative).parent.mkdir(parents=True, exist_ok=True)
            (work / relative).hardlink_to(export_dir / relative)
    except OSError as e:
        shutil.rmtree(work, ignore_errors=True)
        log.warning("%s: no kept copy (%s): remaking this export will need the states captured again", export_dir, e)
        return None
    old = target.with_name(f".{target.name}.old")
    if target.exists():
        os.replace(target, old)
    os.replace(work, target)
    shutil.rmtree(old, ignore_errors=True)
    return target


def sample_ids(shard_dirs: list[str | Path], held_out: Collection[str]) -> list[str]:
    """The ids an export of these shards holds, in its order."""
    return [sid for d in shard_dirs for sid in ShardIndex(d).ids if sid not in held_out]


def kept_ids(kept: Path) -> list[str]:
    return [orjson.loads(line)["id"] for line in (kept / IDS).read_bytes().splitlines()]


def rebuild(
    kept: str | Path,
    shard_dirs: list[str | Path],
    out_dir: str | Path,
    fmt: str,
    *,
    model_path: str | Path | None = None,
    vocab_dir: str | Path | None = None,
    draft_vocab_size: int | None = None,
    held_out: Collection[str] = (),
    settings: dict | None = None,
) -> dict:
    """Write the export of `fmt` of the released `shard_dirs` to `out_dir` from its kept copy `kept`, with the
    arguments `export.export` takes; returns its summary (export.json's, less the file list)."""
    kept, out_dir = Path(kept), Path(out_dir)
    if not (kept / EXPORT_RECORD).is_file():
        raise NeedsStates(f"{out_dir}: its shards were released and {kept} holds no kept {fmt} export")
    record = read_json(kept / EXPORT_RECORD)
    ids = sample_ids(shard_dirs, held_out)
    if ids != kept_ids(kept):
        raise NeedsStates(
            f"{out_dir}: the export would hold {len(ids)} samples, its kept copy {kept} holds other ones "
            f"({record['samples']}: the evaluation's holdout changed?): the states must be captured again"
        )
    shards = [ShardIndex(d) for d in shard_dirs]
    writer = EXPORTS[fmt].exporter()(shards, model_path, vocab_dir, draft_vocab_size, (settings or {}).get(fmt) or {})
    with atomic_dir(out_dir) as tmp:
        files = ExportFiles(tmp)
        summary = {
            "format": fmt,
            "samples": len(ids),
            "held_out": sum(len(s) for s in shards) - len(ids),
            "tokens": record["tokens"],
            "shards": [str(d) for d in shard_dirs],
            "aux_layers": record["aux_layers"],
            "final": record["final"],
        }
        summary.update(writer.side_files(files, out_dir.resolve(), summary))
        rewritten = set(files.checksums)
        if fmt == "specforge":
            summary["rows"] = _specforge_rows(writer, files, kept, record, rewritten)
        for relative, checksum in record["files"].items():
            if relative not in rewritten and relative not in files.checksums:
                files.link(relative, kept / relative, checksum)
        summary.update(checksum=ALGORITHM, files=files.checksums, bytes=files.bytes, rebuilt_from=str(kept))
        write_json(tmp / EXPORT_RECORD, summary)
    return {k: v for k, v in summary.items() if k != "files"}


def _specforge_rows(writer, files: ExportFiles, kept: Path, record: dict, rewritten: set[str]) -> dict:
    """SpecForge's rows from the kept ones: linked where their compression is the configured one, else each
    unzipped or gzipped anew (the same `torch.save` bytes inside); returns export.json's `rows`."""
    was = record["rows"]
    level = writer.gzip_level
    rows = {"compress": "gzip" if level else "none", "level": level, "raw_bytes": was["raw_bytes"]}
    if (was["compress"], was["level"]) == (rows["compress"], level):
        return {**rows, "bytes": was["bytes"]}
    stored = 0
    for number in range(record["samples"]):
        source = kept / specforge_sample_path(number, was["compress"] == "gzip")
        raw = source.read_bytes()
        raw = gzip.decompress(raw) if was["compress"] == "gzip" else raw
        data = gzip.compress(raw, compresslevel=level, mtime=0) if level else raw
        files.write(specforge_sample_path(number, level is not None), data)
        rewritten.add(str(source.relative_to(kept)))
        stored += len(data)
    return {**rows, "bytes": stored}
