#!/usr/bin/env python
"""Choose a partition's held-out prompts for the evaluate stage: `--count` prompt ids, the smallest
sha256 of `seed:id`, from its prompt shards. Every export of the partition leaves them out."""

import logging

from eagle3_datagen import cli
from eagle3_datagen.formats.files import read_jsonl
from eagle3_datagen.formats.holdout import choose_holdout, write_holdout


def main() -> None:
    p = cli.parser(__doc__, stage_settings=False)
    p.add_argument("--prompts", nargs="+", required=True, help="the partition's prompt shards (.jsonl.zst)")
    p.add_argument("--count", type=int, required=True, help="prompts to hold out (evaluate.holdout)")
    p.add_argument("--seed", type=int, required=True, help="evaluate.seed")
    p.add_argument("--out", required=True, help="the holdout file (JSON) to write")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    ids = [row["id"] for path in args.prompts for row in read_jsonl(path)]
    held_out = choose_holdout(ids, args.count, args.seed)
    write_holdout(args.out, held_out, len(ids), args.count, args.seed)
    logging.getLogger("holdout").info("held out %d of %d prompts: %s", len(held_out), len(ids), held_out)


if __name__ == "__main__":
    cli.run(main)
