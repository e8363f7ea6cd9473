#!/usr/bin/env python
"""Compare SGLang with hf on a GPU node: hidden states layer by layer, and greedy /generate IDs.

One command, under five minutes on an H200 (prints a table, exits 1 on a mismatch):
  torchrun --standalone --nproc-per-node 1 scripts/gpu_check.py --launch --out gpu_check.json
--nproc-per-node 2 (or more) checks tensor parallelism too. Without --model it builds a random
Qwen3 (8 layers, hidden 512) with Qwen's tokenizer; the smoke run passes your model (--model, with
--trust-remote-code where the config sets it) at resources.gpus_per_node ranks. Both engines hold the
model at once: where one copy of the checkpoint is over 40% of the GPUs' memory (Kimi-K2.5's ~600 GB on
8 GPUs), both load its first 7 layers instead, a slice of links in a temporary directory (--layers N
sets the count; the smoke run passes the one its plan announced). Layers disagree
when a token's cosine is below 0.99 or the mean below 0.999; generation when a first token differs
or under 90% of the prompts generate exactly hf's IDs. --launch starts `sglang.launch_server` on
rank 0 after the capture; --url checks a server already running instead. On a CPU: --device cpu
--dtype float32 (the tests).
"""

import logging
import sys
import tempfile

from eagle3_datagen import cli
from eagle3_datagen.diagnostics.gpu_check import run_gpu_check
from eagle3_datagen.formats.files import write_json

GPU_LAUNCH_ARGS = ["--mem-fraction-static", "0.3", "--disable-radix-cache"]


def main() -> None:
    p = cli.parser(__doc__, stage_settings=False)
    p.add_argument("--model", help="model directory (default: build a small random Qwen3)")
    p.add_argument("--samples", type=int, default=32, help="random sequences of 8-512 tokens")
    p.add_argument("--max-batch-tokens", type=int, default=4096)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--url", help="compare this server's /generate with hf (default with --launch: port 30000)")
    p.add_argument("--launch", action="store_true", help="start sglang.launch_server for the /generate check")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument(
        "--trust-remote-code", action="store_true", help="the model's own code (the config's model.trust_remote_code)"
    )
    p.add_argument("--layers", type=int, help="compare the model's first N layers (default: sized to the GPUs)")
    p.add_argument("--out", help="write the per-layer numbers and what was loaded here as JSON")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    url = args.url or ("http://127.0.0.1:30000" if args.launch else None)
    launch_args = [*GPU_LAUNCH_ARGS, "--dtype", args.dtype] if args.launch else None
    with tempfile.TemporaryDirectory() as work:
        ok, found = run_gpu_check(
            args.model,
            work,
            args.samples,
            args.max_batch_tokens,
            args.dtype,
            args.device,
            url,
            launch_args,
            args.new_tokens,
            args.trust_remote_code,
            args.layers,
        )
    if found and args.out:
        write_json(args.out, {"ok": ok, **found})
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    cli.run(main)
