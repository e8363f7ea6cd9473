#!/usr/bin/env python
"""Summarize one partition (--partition) or combine partition summaries into HTML (--combine)."""

import argparse
import json

from eagle3_datagen import cli
from eagle3_datagen.formats.files import atomic_path, read_json
from eagle3_datagen.reporting.report import shared_prompts, summary_html, write_partition_summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--partition", help="partition name to summarize")
    p.add_argument("--prompt-stats")
    p.add_argument("--response-stats", nargs="*", default=[])
    p.add_argument("--audits", nargs="*", default=[])
    p.add_argument("--hidden", nargs="*", default=[])
    p.add_argument("--probes", nargs="*", default=[])
    p.add_argument("--combine", nargs="*", help="partition summary JSON files to combine")
    p.add_argument("--prompt-shards", nargs="*", default=[], help="with --combine: every partition's prompt shards")
    p.add_argument(
        "--shard-counts",
        type=json.loads,
        default=[],
        help="with --combine: JSON [[partition, shards], ...], whose --prompt-shards (in order) are whose",
    )
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.combine is not None:
        with atomic_path(args.out) as tmp:
            shared = shared_prompts(args.prompt_shards, args.shard_counts) if args.shard_counts else None
            tmp.write_text(summary_html([read_json(path) for path in args.combine], shared))
    else:
        write_partition_summary(
            args.out,
            name=args.partition,
            prompt_stats=args.prompt_stats,
            response_stats=args.response_stats,
            audits=args.audits,
            hidden_dirs=args.hidden,
            probes=args.probes,
        )


if __name__ == "__main__":
    cli.run(main)
