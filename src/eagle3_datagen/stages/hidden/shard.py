"""One shard's capture: samples in input order, packed with no padding, into parts of at most
`shard_bytes`, then index.json.

The shard's layout (layer numbering, parts, index) is `formats.hidden_shard`'s; the forward passes
are a `backends.base.CaptureBackend`'s (`hf` or `sglang`). Parts are planned from the token counts
before any forward pass, so a rerun after a kill, or after its job was cancelled, keeps every
complete part and recomputes only the rest. On the writer rank a part is encoded, compressed,
checksummed and written by `PartWriter`'s threads while the next part's forward passes run, so the
GPUs do not wait on the CPU (BENCHMARKS.md, "capture's CPU side").
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3_datagen.backends.base import CaptureBackend
from eagle3_datagen.backends.batching import capture_in_batches
from eagle3_datagen.formats.checksums import ALGORITHM
from eagle3_datagen.formats.files import atomic_dir, write_json
from eagle3_datagen.formats.hidden_codec import (
    Codec,
    reference_share,
)
from eagle3_datagen.formats.hidden_shard import (
    FORMAT,
    Layout,
    kept_part_checksum,
    part_key,
    part_metadata,
    plan_parts,
    raw_size,
    write_part,
)
from eagle3_datagen.progress import Progress

log = logging.getLogger(__name__)


class ShardCancelled(Exception):
    """The job that asked for the shard is gone: its complete parts stay for the rerun."""


@dataclass
class _ShardPlan:
    """The parts a shard is cut into, decided from token counts before any forward pass."""

    layout: Layout
    codec: Codec
    lengths: list[int]
    parts: list[range]
    ids: list[list[str]]
    keys: list[str]  # what each part holds: a part from an earlier run is kept only under the same key
    paths: list[Path]
    work: Path

    @property
    def bytes_per_token(self) -> int:
        return self.codec.bytes_per_token(len(self.layout.aux_layers), self.layout.hidden_size)


def _plan(samples: list[dict], out_dir: Path, capture: CaptureBackend, settings: dict) -> _ShardPlan:
    layout = Layout(
        capture.model_name,
        capture.num_layers,
        capture.hidden_size,
        tuple(capture.aux_layers),
        capture.final,
        settings["dtype"],
    )
    codec = Codec.from_settings(settings)
    lengths = [len(s["input_ids"]) for s in samples]
    parts = plan_parts(
        lengths, codec.bytes_per_token(len(layout.aux_layers), layout.hidden_size), settings["shard_bytes"]
    )
    # Work happens in a sibling directory that Snakemake does not own, so complete parts
    # survive a killed job and the output directory appears only when whole.
    work = out_dir.with_name(f".{out_dir.name}.partial")
    ids = [[samples[i]["id"] for i in part] for part in parts]
    keys = [
        part_key(layout, codec, part_ids, [lengths[i] for i in part]) for part, part_ids in zip(parts, ids, strict=True)
    ]
    paths = [work / codec.part_name(number) for number in range(len(parts))]
    return _ShardPlan(layout, codec, lengths, parts, ids, keys, paths, work)


def _resume(plan: _ShardPlan, ranks) -> tuple[list[bool], list[dict | None], list[str | None]]:
    """Per part, whether every rank keeps it from an earlier run, and on the writer its metadata and
    checksum (None: compute it).
    Only the writer reads the files; every rank must skip the same parts or the collectives hang."""
    earlier: list[dict | None] = [None] * len(plan.parts)
    checksums: list[str | None] = [None] * len(plan.parts)
    if ranks.writer:
        plan.work.mkdir(parents=True, exist_ok=True)
        for number, (path, key) in enumerate(zip(plan.paths, plan.keys, strict=True)):
            done = part_metadata(path)
            if done is not None and done["part_key"] == key:
                # A part damaged while no job ran fails its checksum and is recomputed.
                checksums[number] = kept_part_checksum(path)
                earlier[number] = done if checksums[number] else None
    return ranks.agree([done is not None for done in earlier]), earlier, checksums


def writer_threads(setting: str | int, processes: int) -> int:
    """`hidden_states.writer_threads`: a number, or `auto`, the cores this process may run on less one for
    each capture process on the node (the forward passes' own)."""
    if setting != "auto":
        return int(setting)
    return max(1, len(os.sched_getaffinity(0)) - processes)


class PartWriter:
    """The writer rank's CPU side: encodes, compresses, checksums and writes parts on `threads` threads, one
    part each, while the caller computes the next part. A part waits for a free thread (so at most
    `threads` + 1 parts' states are held), and a thread's error is raised at the next part or at
    `results`. Leaving the block waits for the parts in flight, whose files are complete or absent
    (each is written under a temporary name)."""

    def __init__(self, threads: int):
        self.threads = max(1, threads)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="part-writer")
        self._pending: deque[tuple[int, Future]] = deque()
        self._done: dict[int, tuple] = {}

    def __enter__(self) -> PartWriter:
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown(wait=True)

    def submit(self, number: int, write: Callable[..., tuple], *args) -> None:
        while self._pending and (len(self._pending) >= self.threads or self._pending[0][1].done()):
            self._collect()
        self._pending.append((number, self._pool.submit(write, *args)))

    def _collect(self) -> None:
        number, future = self._pending.popleft()
        self._done[number] = future.result()  # a writer's error, raised here

    def results(self) -> dict[int, tuple]:
        """Each written part's result, once every part in flight is written."""
        while self._pending:
            self._collect()
        return self._done


def _write_part(plan: _ShardPlan, number: int, samples: list[dict], states: list) -> tuple:
    """On a writer thread: one part's NaN/Inf check, encoding and file. Returns (nonfinite ids, checksum)."""
    bad = [
        sid
        for sid, (aux, fin) in zip(plan.ids[number], states, strict=True)
        if not (torch.isfinite(aux).all() and torch.isfinite(fin).all())
    ]
    part_tokens = sum(len(s["input_ids"]) for s in samples)
    reference = reference_share(plan.codec.reference_positions, part_tokens, sum(plan.lengths))
    metadata = {"part_key": plan.keys[number], "nonfinite": bad}
    _, checksum = write_part(plan.paths[number], samples, states, plan.codec, metadata, reference, seed=number)
    log.info("part %d: %d samples, %d tokens written", number, len(samples), part_tokens)
    return bad, checksum


def _finish(plan: _ShardPlan, samples: list[dict], out_dir: Path, index_parts: list[dict], nonfinite, settings, timing):
    """Check the NaN/Inf budget, write index.json and move the finished shard into place."""
    # Parts of an earlier plan (another shard_bytes or compression) must not ship with this one,
    # nor the checksum files a resumed run reads (index.json records the checksums).
    for leftover in set(plan.work.iterdir()) - set(plan.paths):
        leftover.unlink()
    limit = settings["max_nonfinite_fraction"]
    if samples and len(nonfinite) / len(samples) > limit:
        raise FloatingPointError(
            f"{len(nonfinite)} of {len(samples)} samples have NaN/Inf hidden states (first: {nonfinite[:5]}), "
            f"above hidden_states.max_nonfinite_fraction={limit}; check the model's dtype"
        )
    index = {
        "format": FORMAT,
        **{k: (list(v) if isinstance(v, tuple) else v) for k, v in plan.layout.__dict__.items()},
        # `raw`: layer N's output before the final norm; `normed`: the final norm's output.
        "final_norm_applied": plan.layout.final == "normed",
        "bytes_per_token": plan.bytes_per_token,
        "samples": len(samples),
        "tokens": sum(plan.lengths),
        "loss_tokens": sum(sum(s["loss_mask"]) for s in samples),
        "bytes": sum(p["bytes"] for p in index_parts),
        "raw_bytes": sum(p["raw_bytes"] for p in index_parts),
        **plan.codec.index_fields(),
        "checksum": ALGORITHM,
        "nonfinite_ids": nonfinite,
        # This job's forward passes and writes (parts kept from an earlier job excluded).
        "throughput": timing,
        "parts": index_parts,
    }
    write_json(plan.work / "index.json", index)
    with atomic_dir(out_dir) as tmp:
        tmp.rmdir()
        os.replace(plan.work, tmp)
    return index


def capture_shard(
    samples: list[dict],
    out_dir: str | Path,
    capture: CaptureBackend,
    settings: dict,
    cancelled: Callable[[], bool] | None = None,
) -> dict | None:
    """Write `samples`' hidden states to `out_dir` (parts, then index.json), resuming a partial run.

    With tensor parallelism every rank calls this with the same samples, runs the same forward
    passes, and only the writer rank writes and returns the index (the others return None). The
    writer writes the parts on `settings["writer_threads"]` threads beside the next part's forward
    passes, a part a thread (`PartWriter`; `auto`: this process's cores less one). `cancelled` is asked before each
    part and before the shard is moved into place (the writer's answer holds on every rank); when it
    says yes, ShardCancelled is raised once the parts in flight are written.
    """
    out_dir = Path(out_dir)
    plan = _plan(samples, out_dir, capture, settings)
    kept, earlier, checksums = _resume(plan, capture.ranks)
    written: dict[int, tuple] = {}
    started, computed_tokens = time.monotonic(), 0
    progress = Progress(len(samples), "samples", log)
    with PartWriter(writer_threads(settings["writer_threads"], processes=1)) as writer:
        for number, part in enumerate(plan.parts):
            _check(cancelled, capture.ranks, out_dir)
            part_samples = [samples[i] for i in part]
            part_tokens = sum(plan.lengths[i] for i in part)
            if kept[number]:
                log.info("part %d: complete from an earlier run, kept", number)
            else:
                states = capture_in_batches(
                    capture, [s["input_ids"] for s in part_samples], settings["max_batch_tokens"]
                )
                if capture.ranks.writer:
                    writer.submit(number, _write_part, plan, number, part_samples, states)
                computed_tokens += part_tokens
            progress.advance(len(part), tokens=part_tokens)
        written = writer.results()
    progress.close()
    _check(cancelled, capture.ranks, out_dir)
    if not capture.ranks.writer:
        return None
    nonfinite: list[str] = []
    index_parts = []
    for number, part in enumerate(plan.parts):
        bad, checksum = written[number] if number in written else (earlier[number]["nonfinite"], checksums[number])
        nonfinite += bad
        path = plan.paths[number]
        index_parts.append(
            {
                "file": path.name,
                "samples": len(part),
                "tokens": sum(plan.lengths[i] for i in part),
                "bytes": path.stat().st_size,
                "raw_bytes": raw_size(path),
                ALGORITHM: checksum,
                "ids": plan.ids[number],
            }
        )
    timing = {"seconds": round(time.monotonic() - started, 3), "tokens": computed_tokens}
    return _finish(plan, samples, out_dir, index_parts, nonfinite, settings, timing)


def _check(cancelled: Callable[[], bool] | None, ranks, out_dir: Path) -> None:
    if cancelled is not None and ranks.agree(cancelled()):
        raise ShardCancelled(f"{out_dir}: cancelled; its complete parts are kept for the rerun")
