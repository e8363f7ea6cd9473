"""One shard's capture: samples in input order, packed with no padding, into parts of at most
`shard_bytes`, then index.json.

The shard's layout (layer numbering, parts, index) is `formats.hidden_shard`'s; the forward passes
are a `backends.base.CaptureBackend`'s (`hf` or `sglang`). Parts are planned from the token counts
before any forward pass, so a rerun after a kill, or after its job was cancelled, keeps every
complete part and recomputes only the rest.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
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


def _compute_part(plan: _ShardPlan, number: int, samples: list[dict], capture: CaptureBackend, settings: dict):
    """Forward passes for one part; on the writer rank, write it. Returns (nonfinite ids, checksum)."""
    states = capture_in_batches(capture, [s["input_ids"] for s in samples], settings["max_batch_tokens"])
    if not capture.ranks.writer:
        return [], None
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
    passes, and only the writer rank writes and returns the index (the others return None).
    `cancelled` is asked before each part and before the shard is moved into place (the writer's
    answer holds on every rank); when it says yes, ShardCancelled is raised.
    """
    out_dir = Path(out_dir)
    plan = _plan(samples, out_dir, capture, settings)
    kept, earlier, checksums = _resume(plan, capture.ranks)
    nonfinite: list[str] = []
    index_parts = []
    started, computed_tokens = time.monotonic(), 0
    progress = Progress(len(samples), "samples", log)
    for number, part in enumerate(plan.parts):
        _check(cancelled, capture.ranks, out_dir)
        part_samples = [samples[i] for i in part]
        part_tokens = sum(plan.lengths[i] for i in part)
        if kept[number]:
            log.info("part %d: complete from an earlier run, kept", number)
            bad = earlier[number]["nonfinite"] if capture.ranks.writer else []
        else:
            bad, checksums[number] = _compute_part(plan, number, part_samples, capture, settings)
            computed_tokens += part_tokens
        progress.advance(len(part), tokens=part_tokens)
        if capture.ranks.writer:
            nonfinite += bad
            path = plan.paths[number]
            index_parts.append(
                {
                    "file": path.name,
                    "samples": len(part),
                    "tokens": part_tokens,
                    "bytes": path.stat().st_size,
                    "raw_bytes": raw_size(path),
                    ALGORITHM: checksums[number],
                    "ids": plan.ids[number],
                }
            )
    progress.close()
    _check(cancelled, capture.ranks, out_dir)
    if not capture.ranks.writer:
        return None
    timing = {"seconds": round(time.monotonic() - started, 3), "tokens": computed_tokens}
    return _finish(plan, samples, out_dir, index_parts, nonfinite, settings, timing)


def _check(cancelled: Callable[[], bool] | None, ranks, out_dir: Path) -> None:
    if cancelled is not None and ranks.agree(cancelled()):
        raise ShardCancelled(f"{out_dir}: cancelled; its complete parts are kept for the rerun")
