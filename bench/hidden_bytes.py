#!/usr/bin/env python
"""Hidden-state stage on CPU with the demo model: bytes on disk, capture overhead, zstd.

On --samples samples of mixed lengths (token IDs drawn from the demo's token shards):
(1) bytes written / (tokens x bytes per token), and what padding every sample to its batch's
longest (batches of --pad-batch in input order, as the reference pipelines do) would write;
(2) tokens/s of the whole stage (capture_shard: forward passes, hooks, copies, writing parts)
over tokens/s of bare forward passes on the same batches;
(3) zstd ratio and MB/s per level on the parts written.

Usage: python bench/hidden_bytes.py [--samples 2000] [--results results]
Run from the repository root after `make demo`, with the project's venv on PATH.
"""

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch
import yaml
import zstandard

from eagle3_datagen.backends.batching import pad_batch, plan_batches
from eagle3_datagen.backends.hf.capture import HFCapture
from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.formats.files import read_jsonl
from eagle3_datagen.stages.hidden.shard import capture_shard


def make_samples(n: int, pool: list[int], seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        length = int(rng.lognormvariate(5.3, 0.8)) % 2000 + 16  # mostly short, a long tail
        start = rng.randrange(len(pool) - length) if len(pool) > length else 0
        ids = (pool * (length // len(pool) + 1))[start : start + length]
        samples.append({"id": f"b{i}", "input_ids": ids, "loss_mask": [int(k > length // 3) for k in range(length)]})
    return samples


@torch.inference_mode()
def bare_forward_seconds(capture: HFCapture, samples: list[dict], max_batch_tokens: int) -> float:
    start = time.perf_counter()
    for batch in plan_batches([len(s["input_ids"]) for s in samples], max_batch_tokens):
        ids, mask = pad_batch([samples[i]["input_ids"] for i in batch], pad_id=0)
        capture.lm.model(input_ids=ids, attention_mask=mask)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--results", default="results")
    p.add_argument("--pad-batch", type=int, default=8)
    p.add_argument("--levels", type=int, nargs="+", default=[1, 3, 9, 19])
    p.add_argument("--model", help="model directory (default: config.yaml's model.path, the demo's)")
    args = p.parse_args()
    torch.set_num_threads(2)
    config = fill_defaults(yaml.safe_load(Path("config.yaml").read_text()))
    model_path = args.model or config["model"]["path"]
    settings = {**config["hidden_states"], "shard_bytes": 64 << 20}
    pool = [
        t
        for path in sorted(Path(args.results).glob("*/tokens/*.jsonl.zst"))
        for s in read_jsonl(path)
        for t in s["input_ids"]
    ]
    samples = make_samples(args.samples, pool)
    capture = HFCapture(model_path, settings["aux_layers"], settings["final"], settings["hf"])
    tokens = sum(len(s["input_ids"]) for s in samples)
    bare = bare_forward_seconds(capture, samples, settings["max_batch_tokens"])
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        index = capture_shard(samples, Path(tmp) / "shard", capture, settings)
        stage = time.perf_counter() - start
        per_token = index["bytes_per_token"]
        lengths = [len(s["input_ids"]) for s in samples]
        padded = sum(
            len(lengths[i : i + args.pad_batch]) * max(lengths[i : i + args.pad_batch])
            for i in range(0, len(lengths), args.pad_batch)
        )
        print(
            f"{len(samples)} samples, {tokens} tokens (lengths {min(lengths)}-{max(lengths)}), "
            f"{per_token} bytes per token, {len(index['parts'])} parts"
        )
        print(
            f"(1) packed: {index['bytes']} bytes, ratio {index['bytes'] / (tokens * per_token):.4f}; "
            f"pad-to-batch-max (batches of {args.pad_batch}): {padded * per_token} bytes, "
            f"ratio {padded / tokens:.4f}"
        )
        print(
            f"(2) bare forward {tokens / bare:.0f} tokens/s ({bare:.1f} s); whole stage {tokens / stage:.0f} "
            f"tokens/s ({stage:.1f} s); ratio {bare / stage:.3f}"
        )
        # The first 32 MB of the parts: level 19 runs at about 1 MB/s.
        data = (Path(tmp) / "shard" / index["parts"][0]["file"]).read_bytes()[: 32 << 20]
        print(f"(3) on {len(data) / 1e6:.0f} MB of parts, one thread:")
        print("    | zstd level | ratio | compress MB/s | decompress MB/s |")
        print("    |---|---|---|---|")
        for level in args.levels:
            start = time.perf_counter()
            packed = zstandard.ZstdCompressor(level=level).compress(data)
            compress_s = time.perf_counter() - start
            start = time.perf_counter()
            zstandard.ZstdDecompressor().decompress(packed)
            decompress_s = time.perf_counter() - start
            mb = len(data) / 1e6
            print(f"    | {level} | {len(data) / len(packed):.3f} | {mb / compress_s:.0f} | {mb / decompress_s:.0f} |")


if __name__ == "__main__":
    main()
