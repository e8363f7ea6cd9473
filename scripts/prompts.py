#!/usr/bin/env python
"""Normalize, deduplicate and shard one partition's raw chat data."""

from eagle3_datagen import cli
from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.formats.sources import Source
from eagle3_datagen.stages.prompts import build_prompts


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
    s = fill_defaults(args.settings, "partitions.*")
    if not s.get("source") and len(args.source) != 1:
        p.error("name one source: --source PATH, or `source` in --settings")
    source = Source(
        s.get("source") or args.source[0],
        subset=s.get("subset"),
        split=s.get("split"),
        # the commit the workflow resolved the revision to, so the job reads what its params name
        revision=s.get("commit") or s.get("revision"),
    )
    build_prompts(
        source,
        s["format"],
        args.out,
        args.stats,
        s.get("system_prompt"),
        s.get("max_prompts"),
        s["max_bad_record_rate"],
        args.earlier,
        allow_empty=s["allow_empty"],
    )


if __name__ == "__main__":
    cli.run(main)
