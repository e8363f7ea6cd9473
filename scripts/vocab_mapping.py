#!/usr/bin/env python
"""Count loss-masked target tokens over token shards and write the draft vocabulary (d2t, t2d)."""

import logging

from eagle3_datagen import cli
from eagle3_datagen.formats.holdout import read_holdout
from eagle3_datagen.stages.vocab import run_vocab


def main() -> None:
    p = cli.parser(__doc__, stage_settings=False)
    p.add_argument("--tokens", nargs="+", required=True, help="token shards (.jsonl.zst)")
    p.add_argument("--model", required=True, help="model directory (its config.json gives the vocabulary size)")
    p.add_argument("--draft-vocab-size", type=int, required=True)
    p.add_argument("--out", required=True, help="directory to create")
    p.add_argument(
        "--holdout", nargs="*", default=[], help="the evaluation's holdout files: their samples are not counted"
    )
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    held_out = [i for path in args.holdout for i in read_holdout(path)]
    summary = run_vocab(args.tokens, args.model, args.draft_vocab_size, args.out, held_out)
    logging.getLogger("vocab").info("%s", summary)


if __name__ == "__main__":
    cli.run(main)
