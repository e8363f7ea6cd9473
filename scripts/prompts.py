#!/usr/bin/env python
"""Normalize, deduplicate and shard one partition's raw chat data."""

from eagle3_datagen import cli
from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.stages.prompts import build_prompts


def main() -> None:
    p = cli.parser(__doc__)
    p.add_argument("--source", required=True, help=".jsonl, .jsonl.zst, .json or .parquet file")
    p.add_argument("--out", nargs="+", required=True, help="one output path per shard, in shard order")
    p.add_argument("--stats", required=True, help="JSON file for the partition's counts")
    p.add_argument(
        "--earlier", nargs="*", default=[], help="earlier partitions' prompt shards: their prompts are left out"
    )
    args = p.parse_args()
    cli.setup(args)
    # the rule's params leave max_bad_record_rate out at its default (workflow.settings.prompt_settings)
    s = fill_defaults(args.settings, "partitions.*")
    build_prompts(
        args.source,
        s["format"],
        args.out,
        args.stats,
        s.get("system_prompt"),
        s.get("max_prompts"),
        s["max_bad_record_rate"],
        args.earlier,
    )


if __name__ == "__main__":
    cli.run(main)
