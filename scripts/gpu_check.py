#!/usr/bin/env python
"""Compare the sglang hidden-state backend with hf, layer by layer, on a GPU node.

Run under torchrun, one process per GPU to test tensor parallelism:
  torchrun --standalone --nproc-per-node 2 scripts/gpu_check.py --out gpu_check.json
Without --model it builds a random Qwen3 (8 layers, hidden 512) with Qwen's tokenizer.
Exits 1 when a layer disagrees (minimum per-token cosine below 0.99, mean below 0.999).
"""

import argparse
import json
import logging
import sys
import tempfile

from eagle3_datagen.gpu_check import run_gpu_check


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model directory (default: build a small random Qwen3)")
    p.add_argument("--samples", type=int, default=32, help="random sequences of 8-512 tokens")
    p.add_argument("--max-batch-tokens", type=int, default=4096)
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--out", help="write the per-layer numbers here as JSON")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    with tempfile.TemporaryDirectory() as work:
        ok, records = run_gpu_check(args.model, work, args.samples, args.max_batch_tokens, args.dtype)
    if records and args.out:
        with open(args.out, "w") as f:
            json.dump({"ok": ok, "layers": records}, f, indent=2)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
