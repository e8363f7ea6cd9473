#!/usr/bin/env python
"""The workflow's summary page (HTML): every partition's summary, the prompts partitions share, the
evaluation's acceptance lengths where the workflow measured them and the data curve (evaluate.fractions):
its fits in --curves-out (JSON), and one line per curve on the console."""

import json
from pathlib import Path

from eagle3_datagen import cli
from eagle3_datagen.formats.files import atomic_path, read_json, write_json
from eagle3_datagen.reporting.report import data_curves, shared_prompts, summary_html


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
    p.add_argument("--curve-points", nargs="*", default=[], help="the data curve's evaluate/curve/*.json files")
    p.add_argument("--plan", help="the plan (results/plan.json), if scripts/plan.py wrote one: the data's price")
    p.add_argument("--out", required=True, help="the page (HTML)")
    p.add_argument("--curves-out", help="the data curves' fits (JSON)")
    args = p.parse_args()
    shared = shared_prompts(args.prompt_shards, args.shard_counts) if args.shard_counts else None
    summaries = [read_json(path) for path in args.summaries]
    evaluations = [read_json(e) for e in args.evaluations]
    plan = read_json(args.plan) if args.plan and Path(args.plan).exists() else None
    curves = data_curves(evaluations, [read_json(c) for c in args.curve_points], summaries, plan)
    for curve in curves:
        cli.console(curve["line"])
    if args.curves_out:
        write_json(args.curves_out, curves)
    page = summary_html(summaries, shared, evaluations, curves)
    with atomic_path(args.out) as tmp:
        tmp.write_text(page)


if __name__ == "__main__":
    cli.run(main)
