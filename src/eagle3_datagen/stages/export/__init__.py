"""Stage: exporters from packed hidden-state shards to the layouts the trainers' releases read.

- `speculators` (`speculators.py`): the directory vLLM speculators 0.9.0's `speculators train
  --data-path` reads: an Arrow dataset of `input_ids`, `loss_mask` and `seq_len` rows in export
  order, `hidden_states/hs_{i}.safetensors` (auxiliary layers, then layer N before the final norm:
  speculators applies the verifier's norm itself; fp8 shards stay fp8 where its release reads them),
  `d2t.npy` / `t2d.npy`, README.md with the command.
- `specforge` (`specforge.py`): SpecForge 0.2.0's offline rows, one `torch.save` dict per sample
  (the final layer after the final norm: SpecForge's target head is the bare LM head), plain or
  gzipped (`export.specforge.compress`), with the draft config, the vocabulary mapping, a ready
  `specforge train` config and a README.

Both leave out the evaluation's held-out samples (`held_out`: their prompt ids, formats/holdout.py),
number the rest in shard order, write `ids.jsonl` (index -> sample id) so no sample loses its
source id, and record in `export.json` the final-slot convention, the bytes written and the xxh3-64
checksum of every file they wrote (hashed from the bytes as written); the directory appears only when
complete. Every part read is checked against its shard's checksum first (`HiddenShard`).

Samples are written in parallel on `threads` threads: parts are read (decompressed, checked) a few
ahead of the samples being written, and each sample's file is encoded, compressed, hashed and written
on a thread of its own; numbers are assigned in shard order first, so the files do not depend on the
number of threads.
"""

from __future__ import annotations

import io
from collections import deque
from collections.abc import Collection, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import orjson

from eagle3_datagen.formats.checksums import ALGORITHM
from eagle3_datagen.formats.files import atomic_dir, write_json
from eagle3_datagen.formats.hidden_shard import HiddenShard
from eagle3_datagen.formats.storage import export_read_ahead
from eagle3_datagen.formats.trainer_exports import EXPORTS
from eagle3_datagen.stages.export.exporter import Exporter
from eagle3_datagen.stages.export.files import ExportFiles


def _shards(shard_dirs: list[str | Path]) -> list[HiddenShard]:
    shards = [HiddenShard(d) for d in shard_dirs]
    layouts = {(tuple(s.index["aux_layers"]), s.index["final"], s.index["hidden_size"]) for s in shards}
    if len(layouts) > 1:
        raise ValueError(f"shards {list(shard_dirs)} store different layouts {sorted(layouts)}; recapture them alike")
    return shards


def _numbered_parts(shards: list[HiddenShard], held_out: Collection[str]) -> Iterator[tuple[HiddenShard, int, int]]:
    """(shard, part number, export number of the part's first kept sample) in shard order."""
    number = 0
    for shard in shards:
        for k, part in enumerate(shard.index["parts"]):
            yield shard, k, number
            number += sum(sid not in held_out for sid in part["ids"])


def _write_samples(
    shards: list[HiddenShard], writer: Exporter, files: ExportFiles, held_out: set, threads: int
) -> list[dict]:
    """Every kept sample written by `writer` on `threads` threads, numbered in shard order; returns each
    sample's id and length. Parts are read `export_read_ahead(threads)` ahead and at most two sample files
    per thread are in flight, which bounds the memory (workflow/job_resources.py sizes the job from it)."""
    kept: list[dict] = []
    raw = writer.stored_states  # the states as stored (fp8 with its scales) or dequantized
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="export") as pool:
        parts = _numbered_parts(shards, held_out)
        reading: deque[tuple[int, Future]] = deque()
        writing: deque[Future] = deque()

        def read_ahead() -> None:
            for shard, k, first in parts:
                reading.append((first, pool.submit(shard.part_samples, k, held_out, raw=raw)))
                if len(reading) >= export_read_ahead(threads):
                    return

        read_ahead()
        while reading:
            first, samples = reading.popleft()
            for offset, sample in enumerate(samples.result()):
                kept.append({"id": sample["id"], "tokens": len(sample["input_ids"])})
                writing.append(pool.submit(writer.add, files, first + offset, sample))
                while len(writing) > 2 * max(1, threads):
                    writing.popleft().result()
            read_ahead()
        for future in writing:
            future.result()
    return kept


def export(
    shard_dirs: list[str | Path],
    out_dir: str | Path,
    fmt: str,
    *,
    model_path: str | Path | None = None,
    vocab_dir: str | Path | None = None,
    draft_vocab_size: int | None = None,
    held_out: Collection[str] = (),
    settings: dict | None = None,
    threads: int = 1,
) -> dict:
    """Write `shard_dirs`' samples in order to `out_dir` in `fmt`'s layout. `model_path` is the target
    (verifier) model directory: SpecForge's export reads its final norm, LM head and config, and both
    name it in their training command; `vocab_dir` is the vocab stage's directory, whose d2t/t2d (of
    `draft_vocab_size` entries) the exports name, not copy: one partition's change then reruns only
    its own export. Samples whose id is in `held_out` (the evaluation's) are not exported. `settings`:
    the validated `export` section (each exporter reads its own, `export.<fmt>`); `threads`: the threads that
    read parts and write samples."""
    if fmt not in EXPORTS:
        raise ValueError(f"export format must be one of {EXPORTS.names()}, not {fmt!r}")
    shards = _shards(shard_dirs)
    index = shards[0].index if shards else {"aux_layers": [], "final": "raw", "hidden_size": 0}
    exporter: type[Exporter] = EXPORTS[fmt].exporter()
    writer = exporter(shards, model_path, vocab_dir, draft_vocab_size, (settings or {}).get(fmt) or {})
    out_dir = Path(out_dir)
    held_out = set(held_out)
    with atomic_dir(out_dir) as tmp:
        files = ExportFiles(tmp)
        kept = _write_samples(shards, writer, files, held_out, threads)
        ids = io.BytesIO()
        for number, sample in enumerate(kept):
            ids.write(orjson.dumps({"index": number, "id": sample["id"]}) + b"\n")
        files.write("ids.jsonl", ids.getvalue())
        summary = {
            "format": fmt,
            "samples": len(kept),
            # the samples left out for the evaluation (some held-out prompts may have no sample)
            "held_out": sum(len(s) for s in shards) - len(kept),
            "tokens": sum(s["tokens"] for s in kept),
            "shards": [str(d) for d in shard_dirs],
            "aux_layers": index["aux_layers"],
            "final": index["final"],
        }
        summary.update(writer.finish(files, out_dir.resolve(), summary))
        summary.update(checksum=ALGORITHM, files=files.checksums, bytes=files.bytes)
        write_json(tmp / "export.json", summary)
    return {k: v for k, v in summary.items() if k != "files"}
