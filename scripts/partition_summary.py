#!/usr/bin/env python
"""One partition's statistics, gathered from every stage's own counts, as JSON."""

from eagle3_datagen import cli
from eagle3_datagen.reporting.report import write_partition_summary


def main() -> None:
    p = cli.parser(__doc__, stage_settings=False)
    p.add_argument("--partition", required=True, help="the partition's name")
    p.add_argument("--prompt-stats", required=True, help="the prompts stage's stats.json")
    p.add_argument("--response-stats", nargs="*", default=[], help="each shard's responses stats.json")
    p.add_argument("--audits", nargs="*", default=[], help="each shard's token audit.json")
    p.add_argument("--hidden", nargs="*", default=[], help="each shard's hidden-state directory")
    p.add_argument("--probes", nargs="*", default=[], help="each shard's probe JSON")
    p.add_argument("--out", required=True, help="the partition's summary (JSON)")
    args = p.parse_args()
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
