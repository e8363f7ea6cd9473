#!/usr/bin/env python
"""Probe cost as a fraction of the hidden-state stage, on the demo's shards, in one process.

For each demo token shard: the hidden-state capture (model load + forward passes + writing parts)
and the probe (LM head + norm read + probing at the default budget) are timed, each from a cold
start of its own work, excluding the Python imports both jobs share.

Usage: python bench/probe_cost.py [--results results] [--repeats 3]
Run from the repository root after `make demo`, with the project's venv on PATH.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import yaml

from eagle3_datagen.backends.hf.capture import HFCapture
from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.formats.files import read_jsonl
from eagle3_datagen.stages.hidden.shard import capture_shard
from eagle3_datagen.stages.probe import LMHead, ProbeSettings, probe_shard


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default="results")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", help="model directory (default: config.yaml's model.path, the demo's)")
    args = p.parse_args()
    torch.set_num_threads(2)
    config = fill_defaults(yaml.safe_load(Path("config.yaml").read_text()))
    model_path = args.model or config["model"]["path"]
    settings = ProbeSettings.from_config(config["probe"])
    shards = sorted(Path(args.results).glob("*/tokens/*.jsonl.zst"))
    hidden_times, probe_times, positions = [], [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            hidden_s = probe_s = 0.0
            for n, tokens in enumerate(shards):
                out = Path(tmp) / f"{repeat}-{n}"
                start = time.perf_counter()
                hidden = config["hidden_states"]
                capture = HFCapture(model_path, hidden["aux_layers"], hidden["final"], hidden["hf"])
                capture_shard(read_jsonl(tokens), out, capture, hidden)
                hidden_s += time.perf_counter() - start
                start = time.perf_counter()
                result = probe_shard(out, LMHead(model_path), settings)
                probe_s += time.perf_counter() - start
                positions += result["positions_probed"] if repeat == 0 else 0
            hidden_times.append(hidden_s)
            probe_times.append(probe_s)
    hidden, probe = statistics.median(hidden_times), statistics.median(probe_times)
    print(f"{len(shards)} shards, {positions} positions probed (max_positions={settings.max_positions} per shard)")
    print(f"hidden-state stage: {hidden:.2f} s (runs: {', '.join(f'{t:.2f}' for t in hidden_times)})")
    print(f"probe: {probe:.2f} s (runs: {', '.join(f'{t:.2f}' for t in probe_times)})")
    print(f"probe / hidden: {probe / hidden:.3f}")


if __name__ == "__main__":
    main()
