#!/usr/bin/env python
"""Tell which partitions are complete, running, stale, failed or pending, from Snakemake's records.

Run from the workflow directory with the run's --configfile and --profile.
"""

import json
from pathlib import Path

import yaml

from eagle3_datagen import cli
from eagle3_datagen.reporting.status import (
    format_states,
    incomplete_outputs,
    is_locked,
    parse_summary,
    partition_states,
)


def main() -> None:
    p = cli.parser(__doc__, stage_settings=False)
    p.add_argument("--configfile", help="the run's config (default: config.yaml)")
    p.add_argument("--profile", default="profiles/local")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    command = ["--summary", "--profile", args.profile, "--nolock"]
    if args.configfile:
        command += ["--configfile", args.configfile]
    # A run going on beside it may replace an output while --summary reads it: read again.
    summary = cli.run_snakemake(command, retry_when="a concurrent process has deleted it")
    config = yaml.safe_load(Path(args.configfile or "config.yaml").read_text())
    locked = is_locked(".")
    states = partition_states(
        parse_summary(summary), sorted(config["partitions"]), ".", incomplete_outputs("."), locked
    )
    print(json.dumps(states, indent=2) if args.json else format_states(states))


if __name__ == "__main__":
    cli.run(main)
