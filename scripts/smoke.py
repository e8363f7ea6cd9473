#!/usr/bin/env python
"""The smoke run: your own config on the real node before the week's run, its time said before it starts.

    python scripts/smoke.py --configfile my.yaml --profile profiles/gpu

Prints its steps, the model loads of each and their estimated minutes (the plan's rates and load
seconds), then runs and times them, each said to PASS, FAIL or SKIP (with why), each GPU step in a
process of its own once the GPUs' memory is free: the GPU check (SGLang against hf on your model, at
resources.gpus_per_node ranks); the workflow on one shard of at most --prompts prompts of one partition
per backend, greedy, without baseline twins (--baseline keeps yours), in smoke/ (the week's results are
untouched); the probe (top-1 agreement at least
0.98 on greedy data); the auxiliary layers and final slot of --samples samples against every layer the
capture runner's hooks recorded (reversed layers, a layer one off, a missing final norm; no second
model load); a small SpecForge draft served with SGLang's EAGLE3 on a GPU node (on a CPU, the evaluate
stage's transformers measurement); and the measured generation and capture tokens/s and model load
seconds, written to logs/smoke/ where scripts/plan.py (and the next smoke run's estimate) reads them.
Exits 1 when a step fails. Run from the workflow directory.
"""

import sys
from pathlib import Path

import yaml

from eagle3_datagen import cli
from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.diagnostics.smoke import (
    Smoke,
    SmokeError,
    planned_steps,
    prepare,
    smoke_config,
    smoke_partitions,
)


def main() -> None:
    p = cli.parser(__doc__, stage_settings=False)
    p.add_argument("--configfile", required=True, help="your run's config")
    p.add_argument("--profile", default="profiles/gpu", help="your run's profile (default: profiles/gpu)")
    p.add_argument("--prompts", type=int, default=200, help="prompts per smoke partition (default: 200)")
    p.add_argument("--partitions", nargs="+", help="the partitions to run (default: the first of each backend)")
    p.add_argument("--samples", type=int, default=4, help="samples a shard whose layers are checked (default: 4)")
    p.add_argument("--work", default="smoke", help="the smoke run's directory (default: smoke; emptied first)")
    p.add_argument(
        "--baseline",
        action="store_true",
        help="keep your evaluate.baseline (its twins on the dataset's own responses, a second draft per evaluation)",
    )
    args = p.parse_args()
    root = Path.cwd()
    if not (root / "Snakefile").exists():
        p.error("run it from the workflow directory (where the Snakefile is)")
    config = fill_defaults(yaml.safe_load(Path(args.configfile).read_text()))
    partitions = smoke_partitions(config, args.partitions)
    smoke = smoke_config(config, partitions, args.prompts, args.samples, root, args.baseline)
    work = (root / args.work).resolve()
    prepare(work, root, smoke)
    profile = str(root / args.profile) if (root / args.profile).exists() else args.profile
    smoke = fill_defaults(smoke)
    runner = Smoke(root, work, smoke, profile, sys.stdout)
    ok = runner.run(planned_steps(smoke, config, root, runner.gpus, runner.gpu_bytes))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    cli.run(main, (SmokeError,))
