#!/usr/bin/env python
"""The speculators export on the demo's shards, and speculators 0.9.0's CPU step time on it.

(1) Seconds per 1,000 samples of `export(..., "speculators")` over every demo partition's hidden
shards (best of --repeat runs, into a temporary directory), and bytes per token of what it writes
(all files, and the `hidden_states/hs_i.safetensors` files alone).
(2) With --train: `speculators train` (tests/trainers/speculators_on_cpu.py, the CPU patch the trainer
tests use) for --epochs epochs on the largest partition's export; the median of its own
`profile/step_ms` over the steps after the first (labelled CPU).

Usage: python bench/export_speculators.py [--results results] [--repeat 3] [--train]
Run from the repository root after `make demo` and `make speculators-env`, with .venv on PATH.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from eagle3_datagen.stages.export import export

REPO = Path(__file__).resolve().parents[1]


def demo_shards(results: Path) -> dict[str, list[Path]]:
    return {
        p.name: sorted(d for d in (p / "hidden").iterdir() if (d / "index.json").exists())
        for p in sorted(results.iterdir())
        if (p / "hidden").is_dir()
    }


def time_exports(shards: dict[str, list[Path]], results: Path, repeat: int, work: Path) -> dict:
    best, samples, tokens, size, states = float("inf"), 0, 0, 0, 0
    for attempt in range(repeat):
        started = time.perf_counter()
        for partition, dirs in shards.items():
            out = work / f"{attempt}" / partition
            vocab = results / "vocab"
            summary = export(
                dirs,
                out,
                "speculators",
                model_path=results / "demo" / "model",
                vocab_dir=vocab,
                draft_vocab_size=len(np.load(vocab / "d2t.npy")),
            )
            if attempt == 0:
                samples += summary["samples"]
                tokens += summary["tokens"]
                files = [f for f in out.rglob("*") if f.is_file()]
                size += sum(f.stat().st_size for f in files)
                states += sum(f.stat().st_size for f in (out / "hidden_states").iterdir())
        best = min(best, time.perf_counter() - started)
    return {
        "samples": samples,
        "tokens": tokens,
        "seconds": round(best, 3),
        "seconds_per_1000_samples": round(1000 * best / samples, 3),
        "bytes_per_token": round(size / tokens, 1),
        "hs_bytes_per_token": round(states / tokens, 1),
    }


def train_step_ms(export_dir: Path, model: Path, vocab: Path, epochs: int, work: Path) -> dict:
    d2t = vocab / "d2t.npy"
    command = [
        str(REPO / ".venv-speculators/bin/python"), str(REPO / "tests/trainers/speculators_on_cpu.py"), "train",
        "--verifier-name-or-path", str(model), "--data-path", str(export_dir),
        "--target-layer-ids", *map(str, json.loads((export_dir / "export.json").read_text())["aux_layers"]),
        "--on-missing", "raise", "--draft-vocab-size", str(len(np.load(d2t))),
        "--d2t-path", str(d2t), "--t2d-path", str(vocab / "t2d.npy"),
        "--save-path", str(work / "run"), "--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
        "--num-workers", "0", "--epochs", str(epochs), "--log-freq", "1",
    ]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "COLUMNS": "300"}, check=True)
    log = run.stdout + run.stderr
    steps = [float(v) for v in re.findall(r"profile/step_ms=([0-9.e+-]+)", log)]
    tokens = [float(v) for v in re.findall(r"profile/tokens_per_s=([0-9.e+-]+)", log)]
    return {
        "device": "CPU",
        "steps": len(steps),
        "median_step_ms_after_first": round(statistics.median(steps[1:]), 1),
        "median_tokens_per_s": round(statistics.median(tokens[1:]), 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default="results", type=Path)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--train", action="store_true", help="also time speculators train on CPU")
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args()
    shards = demo_shards(args.results)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        result = {"export": time_exports(shards, args.results, args.repeat, work)}
        if args.train:
            largest = max(
                shards, key=lambda name: sum(json.loads((d / "index.json").read_text())["tokens"] for d in shards[name])
            )
            result["train"] = {
                "partition": largest,
                **train_step_ms(
                    work / "0" / largest, args.results / "demo" / "model", args.results / "vocab", args.epochs, work
                ),
            }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
