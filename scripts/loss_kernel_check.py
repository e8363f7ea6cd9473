#!/usr/bin/env python
"""On a GPU, check SpecForge 0.2.0's Triton loss kernel against the reference implementation its own
module keeps, which the CPU evaluation trains with in its place: loss and gradient on the same inputs.

Prints one line per shape and dtype, writes them to --out, exits 1 where they disagree. Runs under
SpecForge's venv on a CUDA torch (SpecForge pins torch 2.11.0), under a minute on an H200:
  python scripts/loss_kernel_check.py --out loss_kernel.json
"""

import json
import sys

import torch

from eagle3_datagen import cli
from eagle3_datagen.formats.files import write_json
from eagle3_datagen.stages.evaluate.loss_kernel import specforge_kernel_agreement

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def shape(text: str) -> tuple[int, int, int]:
    batch, length, vocab = (int(n) for n in text.split(","))
    return batch, length, vocab


def main() -> None:
    p = cli.parser(__doc__, stage_settings=False)
    p.add_argument(
        "--shapes",
        nargs="+",
        type=shape,
        default=[(2, 1024, 32000), (4, 2048, 32000)],
        help="BATCH,LENGTH,VOCAB of the draft's logits (default: Kimi-K2.5 drafts' 32000-token vocabulary)",
    )
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=sorted(DTYPES))
    p.add_argument("--out", required=True, help="the figures (JSON)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("no CUDA device: the kernel is Triton's, for a GPU")
    results = specforge_kernel_agreement(args.shapes, [DTYPES[d] for d in args.dtypes])
    for r in results:
        print(json.dumps(r, sort_keys=True))
    write_json(args.out, {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results})
    sys.exit(0 if all(r["agree"] for r in results) else 1)


if __name__ == "__main__":
    cli.run(main)
