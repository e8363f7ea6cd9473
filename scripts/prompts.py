#!/usr/bin/env python
"""Normalize, deduplicate and shard one partition's raw chat data."""

from eagle3_datagen import cli
from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.stages.prompts import partition_prompts


def main() -> None:
    p = cli.parser(__doc__)
    p.add_argument(
        "--source",
        nargs="*",
        default=[],
        help="a data file (.jsonl, .json, plain or .gz/.bz2/.xz/.zst; .parquet; .arrow) or a directory; the "
        "settings' `source` (a glob, whose files the workflow passes here, or hf:owner/name) comes first "
        "(docs/sources.md)",
    )
    p.add_argument("--out", nargs="+", required=True, help="one output path per shard, in shard order")
    p.add_argument("--stats", required=True, help="JSON file for the partition's counts")
    p.add_argument(
        "--earlier", nargs="*", default=[], help="earlier partitions' prompt shards: their prompts are left out"
    )
    args = p.parse_args()
    cli.setup(args, torch_threads=False)
    # the workflow passes every key (prompt_settings); a command run by hand may leave out those with a default
    partition_prompts(fill_defaults(args.settings, "partitions.*"), args.source, args.out, args.stats, args.earlier)


if __name__ == "__main__":
    cli.run(main)
