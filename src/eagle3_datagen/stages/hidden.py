"""Stage 4: one prefill pass captures EAGLE-3's auxiliary layers and the final layer.

The shard's layout (layer numbering, parts, index) is `formats.hidden_shard`'s; the forward
passes are a `backends.base.CaptureBackend`'s (`hf` or `sglang`). Samples are written in input
order, packed with no padding, into parts of at most `shard_bytes`. Parts are planned from the
token counts before any forward pass, so a rerun after a kill keeps every complete part and
recomputes only the rest.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from eagle3_datagen.backends.base import CaptureBackend
from eagle3_datagen.backends.batching import capture_in_batches
from eagle3_datagen.backends.hf.capture import HFCapture
from eagle3_datagen.formats.files import atomic_dir, read_jsonl, write_json
from eagle3_datagen.formats.hidden_codec import (
    Codec,
    reference_share,
)
from eagle3_datagen.formats.hidden_shard import (
    FORMAT,
    Layout,
    part_key,
    part_metadata,
    plan_parts,
    raw_size,
    write_part,
)
from eagle3_datagen.progress import Progress

log = logging.getLogger(__name__)


def capture_shard(samples: list[dict], out_dir: str | Path, capture: CaptureBackend, settings: dict) -> dict | None:
    """Write `samples`' hidden states to `out_dir` (parts, then index.json), resuming a partial run.

    With tensor parallelism every rank calls
    this with the same samples, runs the same forward passes, and only the writer rank writes and
    returns the index (the others return None).
    """
    out_dir = Path(out_dir)
    ranks = capture.ranks
    layout = Layout(
        capture.model_name,
        capture.num_layers,
        capture.hidden_size,
        tuple(capture.aux_layers),
        capture.final,
        settings["dtype"],
    )
    codec = Codec.from_settings(settings)
    per_token = codec.bytes_per_token(len(layout.aux_layers), layout.hidden_size)
    lengths = [len(s["input_ids"]) for s in samples]
    parts = plan_parts(lengths, per_token, settings["shard_bytes"])
    # Work happens in a sibling directory that Snakemake does not own, so complete parts
    # survive a killed job and the output directory appears only when whole.
    work = out_dir.with_name(f".{out_dir.name}.partial")
    ids = [[samples[i]["id"] for i in part] for part in parts]
    keys = [
        part_key(layout, codec, part_ids, [lengths[i] for i in part]) for part, part_ids in zip(parts, ids, strict=True)
    ]
    paths = [work / codec.part_name(number) for number in range(len(parts))]
    earlier: list[dict | None] = [None] * len(parts)
    if ranks.writer:
        work.mkdir(parents=True, exist_ok=True)
        earlier = [part_metadata(path) for path in paths]
    # Only the writer reads the files; every rank must skip the same parts or the collectives hang.
    kept = ranks.agree([done is not None and done["part_key"] == key for done, key in zip(earlier, keys, strict=True)])
    nonfinite: list[str] = []
    index_parts = []
    started, computed_tokens = time.monotonic(), 0
    progress = Progress(len(samples), "samples", log)
    for number, part in enumerate(parts):
        part_samples = [samples[i] for i in part]
        part_tokens = sum(lengths[i] for i in part)
        if kept[number]:
            log.info("part %d: complete from an earlier run, kept", number)
            if ranks.writer:
                nonfinite += earlier[number]["nonfinite"]
        else:
            states = capture_in_batches(capture, [s["input_ids"] for s in part_samples], settings["max_batch_tokens"])
            if ranks.writer:
                bad = [
                    sid
                    for sid, (aux, fin) in zip(ids[number], states, strict=True)
                    if not (torch.isfinite(aux).all() and torch.isfinite(fin).all())
                ]
                nonfinite += bad
                metadata = {"part_key": keys[number], "nonfinite": bad}
                reference = reference_share(codec.reference_positions, part_tokens, sum(lengths))
                write_part(paths[number], part_samples, states, codec, metadata, reference, seed=number)
                computed_tokens += part_tokens
                log.info("part %d: %d samples, %d tokens written", number, len(part), part_tokens)
        progress.advance(len(part), tokens=part_tokens)
        if ranks.writer:
            index_parts.append(
                {
                    "file": paths[number].name,
                    "samples": len(part),
                    "tokens": part_tokens,
                    "bytes": paths[number].stat().st_size,
                    "raw_bytes": raw_size(paths[number]),
                    "ids": ids[number],
                }
            )
    progress.close()
    if not ranks.writer:
        return None
    # Parts of an earlier plan (another shard_bytes or compression) must not ship with this one.
    for stale in set(work.iterdir()) - set(paths):
        stale.unlink()
    limit = settings.get("max_nonfinite_fraction", 0.0)
    if samples and len(nonfinite) / len(samples) > limit:
        raise FloatingPointError(
            f"{len(nonfinite)} of {len(samples)} samples have NaN/Inf hidden states (first: {nonfinite[:5]}), "
            f"above hidden_states.max_nonfinite_fraction={limit}; check the model's dtype"
        )
    index = {
        "format": FORMAT,
        **{k: (list(v) if isinstance(v, tuple) else v) for k, v in layout.__dict__.items()},
        "bytes_per_token": per_token,
        "samples": len(samples),
        "tokens": sum(lengths),
        "loss_tokens": sum(sum(s["loss_mask"]) for s in samples),
        "bytes": sum(p["bytes"] for p in index_parts),
        "raw_bytes": sum(p["raw_bytes"] for p in index_parts),
        **codec.index_fields(),
        "nonfinite_ids": nonfinite,
        # This job's forward passes and writes (parts kept from an earlier job excluded).
        "throughput": {"seconds": round(time.monotonic() - started, 3), "tokens": computed_tokens},
        "parts": index_parts,
    }
    write_json(work / "index.json", index)
    with atomic_dir(out_dir) as tmp:
        tmp.rmdir()
        os.replace(work, tmp)
    return index


def run_hidden(
    tokens_path: str | Path, out_dir: str | Path, model_path: str | Path, model_settings: dict, settings: dict
) -> dict | None:
    """Capture one token shard with the configured backend (`hf` or `sglang`)."""
    trust_remote_code = model_settings.get("trust_remote_code", False)
    if settings.get("backend", "hf") == "sglang":
        from eagle3_datagen.backends.sglang.capture import load_sglang_capture

        capture = load_sglang_capture(
            model_path,
            settings["aux_layers"],
            settings["final"],
            settings.get("sglang", {}),
            trust_remote_code,
            settings["max_batch_tokens"],
        )
    else:
        capture = HFCapture(
            model_path, settings["aux_layers"], settings["final"], settings.get("hf", {}), trust_remote_code
        )
    return capture_shard(read_jsonl(tokens_path), out_dir, capture, settings)
