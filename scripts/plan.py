#!/usr/bin/env python
"""Plan a run without calling any model: per partition that `snakemake -n` would regenerate,
prompts, prompt and completion tokens, OpenRouter cost, node-hours and hidden-state bytes, and how
many times each model loads in the planned run and what that costs.

It first builds the prompt shards (cheap, CPU only) so that prompts can be counted and tokenized
with the model's tokenizer (a demo's before its model is built; plan.tokenizer's where the model is
not mounted), then reads Snakemake's dry-run to see which partitions are invalidated. The plan is
also written to results/plan.json, whose hidden-state bytes a run checks against the free disk
before its first job. Run from the workflow directory, with the same --configfile and --profile as the run.
"""

import json
from pathlib import Path

import yaml

from eagle3_datagen import cli
from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.formats.files import write_json
from eagle3_datagen.workflow.preflight import PLAN_FILE


def main() -> None:
    p = cli.parser(__doc__, stage_settings=False)
    p.add_argument("--configfile", help="the run's config (default: config.yaml)")
    p.add_argument("--profile", default="profiles/local", help="the run's profile (default: profiles/local)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = p.parse_args()
    common = ["--profile", args.profile] + (["--configfile", args.configfile] if args.configfile else [])
    # the dry-runs below validate it; the plan reads the defaults the workflow fills
    config = fill_defaults(yaml.safe_load(Path(args.configfile or "config.yaml").read_text()))
    # The prompts rules as targets, not `--until`: under `prompts.shared_across_partitions: drop` one
    # reads another's shards, and Snakemake stops such an `--until` set after its first job ("BUG: Out
    # of jobs ready to be started", snakemake/snakemake#823).
    prompt_rules = [f"prompts_{name}" for name in config["partitions"]]
    cli.run_snakemake([*prompt_rules, *common, "--cores", "2", "--quiet", "all"])
    dry_run = cli.run_snakemake([*common, "-n"])
    # Only counting tokens needs the tokenizer (transformers, torch): --help and Snakemake's calls do not.
    from eagle3_datagen.reporting.plan import format_plan, make_plan, scheduled_jobs, scheduled_partitions

    jobs = scheduled_jobs(dry_run)
    # A cluster executor runs each job (or group job) in an allocation of its own: a node service loads in each.
    executor = (yaml.safe_load((Path(args.profile) / "config.yaml").read_text()) or {}).get("executor", "local")
    plan = make_plan(config, sorted(scheduled_partitions(jobs)), jobs=jobs, per_allocation=executor != "local")
    write_json(PLAN_FILE, plan)
    print(json.dumps(plan, indent=2) if args.json else format_plan(plan))


if __name__ == "__main__":
    cli.run(main)
