#!/usr/bin/env python
"""The workflow's summary page (HTML): every partition's summary, the prompts partitions share, and the
evaluation's acceptance lengths where the workflow measured them."""

import json

from eagle3_datagen import cli
from eagle3_datagen.formats.files import atomic_path, read_json
from eagle3_datagen.reporting.report import shared_prompts, summary_html


def main() -> None:
    p = cli.parser(__doc__, stage_settings=False)
    p.add_argument("--summaries", nargs="+", required=True, help="each partition's summary (JSON)")
    p.add_argument("--prompt-shards", nargs="*", default=[], help="every partition's prompt shards")
    p.add_argument(
        "--shard-counts",
        type=json.loads,
        default=[],
        help="JSON [[partition, shards], ...]: whose --prompt-shards (in order) are whose",
    )
    p.add_argument("--evaluations", nargs="*", default=[], help="the partitions' evaluate/acceptance.json files")
    p.add_argument("--out", required=True, help="the page (HTML)")
    args = p.parse_args()
    shared = shared_prompts(args.prompt_shards, args.shard_counts) if args.shard_counts else None
    page = summary_html([read_json(path) for path in args.summaries], shared, [read_json(e) for e in args.evaluations])
    with atomic_path(args.out) as tmp:
        tmp.write_text(page)


if __name__ == "__main__":
    cli.run(main)
