#!/usr/bin/env python
# ruff: noqa: E402 (the imports come after Ctrl-C's default action is set)
"""Tell which partitions are complete, running, stale, failed or pending, from Snakemake's records, and
per partition what its responses have done so far, read from their journals and stats while the run
goes: prompts answered, failed, truncated and gated, tokens, dollars and rows per minute.

Run from the workflow directory with the run's --configfile and --profile. With --watch SECONDS, the
responses' progress alone, again every SECONDS (rows per minute over each interval), until Ctrl-C,
which ends it at once, whatever it is doing (loading the tokenizer, reading journals).
"""

import json
import signal
import sys
import time
from pathlib import Path

# Ctrl-C ends it at once by the signal's default action, from before its imports (seconds on a busy machine):
# Python's KeyboardInterrupt waits for native code to return (the tokenizer's took over 30 s). It writes
# nothing, so nothing is left half done.
signal.signal(signal.SIGINT, signal.SIG_DFL)

import yaml

from eagle3_datagen import cli
from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.reporting.live import format_progress, model_gates, rates, run_progress
from eagle3_datagen.reporting.status import (
    format_states,
    incomplete_outputs,
    is_locked,
    parse_summary,
    partition_states,
)
from eagle3_datagen.workflow.partitions import shard_names


def main() -> None:
    p = cli.parser(__doc__, stage_settings=False)
    p.add_argument("--configfile", help="the run's config (default: config.yaml)")
    p.add_argument("--profile", default="profiles/local")
    p.add_argument("--json", action="store_true")
    p.add_argument("--watch", type=float, metavar="SECONDS", help="the responses' progress every SECONDS")
    p.add_argument(
        "--no-gates",
        action="store_true",
        help="count gated rows only where the tokens stage ran (else the gates are applied here, with the "
        "model's tokenizer, to the rows it has not seen yet)",
    )
    args = p.parse_args()
    config = fill_defaults(yaml.safe_load(Path(args.configfile or "config.yaml").read_text()))
    partitions = sorted(config["partitions"])
    shards = {name: shard_names(config, name) for name in partitions}
    gates, why_not = (None, None) if args.no_gates else model_gates(config)
    note = f"gated rows counted where the tokens stage ran (gates not applied here: {why_not})" if why_not else None
    if args.watch:
        watch(shards, gates, args.watch, note)
        return
    command = ["--summary", "--profile", args.profile, "--nolock"]
    if args.configfile:
        command += ["--configfile", args.configfile]
    # A run going on beside it may replace an output while --summary reads it: read again.
    summary = cli.run_snakemake(command, retry_when="a concurrent process has deleted it")
    states = partition_states(parse_summary(summary), partitions, ".", incomplete_outputs("."), is_locked("."))
    progress = run_progress(".", shards, gates)
    if args.json:
        print(json.dumps({p: {**states[p], "responses": progress[p].as_dict()} for p in partitions}, indent=2))
        return
    print(format_states(states))
    print()
    print(format_progress(progress))
    if note:
        print(note)


def watch(shards: dict[str, list[str]], gates, seconds: float, note: str | None) -> None:
    before, at = run_progress(".", shards, gates), time.monotonic()
    # Flushed at once: Ctrl-C ends the process without flushing a pipe's buffer (`status.py --watch | tee`).
    print(format_progress(before), flush=True)
    while True:
        time.sleep(seconds)
        after, now = run_progress(".", shards, gates), time.monotonic()
        print(f"\n{time.strftime('%H:%M:%S')}, rows per minute over the last {now - at:.0f} s")
        print(format_progress(rates(before, after, now - at)))
        if note:
            print(note)
        sys.stdout.flush()
        before, at = after, now


if __name__ == "__main__":
    cli.run(main)
