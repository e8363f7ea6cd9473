#!/usr/bin/env python
"""Time the SpecForge export and measure its bytes per token.

Exports the given hidden-state shards (listed `--repeat` times, so that a small capture makes
thousands of samples) with `stages.export.export(..., "specforge", ...)` into a temporary directory,
and prints JSON: samples, tokens, CPU and wall seconds (and per 1,000 samples), bytes of the `.ckpt`
rows on disk per token, and the shards' own bytes per token for comparison.
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

from eagle3_datagen.formats.hidden_shard import HiddenShard
from eagle3_datagen.stages.export import export


def measure(shards: list[str], model: str, vocab: str | None, repeat: int) -> dict:
    listed = shards * repeat
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "specforge"
        wall, cpu = time.perf_counter(), time.process_time()
        summary = export(listed, out, "specforge", model_path=model, vocab_dir=vocab)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        row_bytes = sum(p.stat().st_size for p in out.glob("rows_*/*.ckpt"))
    shard_bytes = sum(HiddenShard(s).index["bytes"] for s in listed)
    samples, tokens = summary["samples"], summary["tokens"]
    return {
        "samples": samples,
        "tokens": tokens,
        "final_norm_applied": summary["final_norm_applied"],
        "cpu_seconds": round(cpu, 2),
        "wall_seconds": round(wall, 2),
        "cpu_seconds_per_1000_samples": round(1000 * cpu / samples, 2),
        "wall_seconds_per_1000_samples": round(1000 * wall / samples, 2),
        "ckpt_bytes_per_token": round(row_bytes / tokens, 1),
        "shard_bytes_per_token": round(shard_bytes / tokens, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hidden", nargs="+", required=True, help="hidden-state shard directories")
    p.add_argument("--model", required=True, help="the target model directory")
    p.add_argument("--vocab", help="the vocabulary stage's directory")
    p.add_argument("--repeat", type=int, default=1, help="export the shards this many times over")
    args = p.parse_args()
    print(json.dumps(measure(args.hidden, args.model, args.vocab, args.repeat), indent=2))


if __name__ == "__main__":
    main()
