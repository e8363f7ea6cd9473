#!/usr/bin/env python
"""Train a draft on a partition's SpecForge export with SpecForge 0.2.0 on one GPU (`specforge train` as
released, evaluate.steps steps), serve the target with it under SGLang 0.5.23's EAGLE3, and measure its
acceptance length on the held-out prompts (SGLang's spec_verify_ct and spec_accept_length): the smoke
run's draft step on a GPU node, where the evaluate stage's CPU measurement cannot hold the target.

Runs under SpecForge's venv (evaluate.python, with its CUDA torch); the server under --sglang-python.
"""

import json
import sys
import tempfile
from pathlib import Path

from eagle3_datagen import cli
from eagle3_datagen.formats.files import read_jsonl, write_json
from eagle3_datagen.formats.holdout import read_holdout
from eagle3_datagen.stages.evaluate.draft import train_config, train_draft
from eagle3_datagen.stages.evaluate.measure import held_out_prompt, held_out_samples
from eagle3_datagen.stages.evaluate.serving import sglang_eagle3_acceptance


def main() -> None:
    p = cli.parser(__doc__)
    p.add_argument("--export", required=True, help="the partition's SpecForge export directory")
    p.add_argument("--tokens", nargs="+", required=True, help="token shards holding the held-out samples")
    p.add_argument("--holdout", required=True, help="the partition's holdout.json")
    p.add_argument("--launch", required=True, type=json.loads, help="inference.sglang.launch as JSON")
    p.add_argument("--url", required=True, help="where the server listens, e.g. http://127.0.0.1:30000")
    p.add_argument("--sglang-python", required=True, help="the interpreter with SGLang 0.5.23")
    p.add_argument("--server-log", required=True, help="the server's output")
    p.add_argument("--out", required=True, help="the figures (JSON)")
    args = p.parse_args()
    cli.setup(args)
    settings = {**args.settings, "device": "cuda"}
    ids = read_holdout(args.holdout)
    held_out = held_out_samples((row for path in args.tokens for row in read_jsonl(path)), ids)
    export = Path(args.export)
    launch = {**args.launch, "command": [args.sglang_python, "-m", "sglang.launch_server"]}
    target = train_config(export)["model"]["target_model_path"]
    with tempfile.TemporaryDirectory(prefix=".serve-draft-", dir=Path(args.out).parent) as work:
        draft = train_draft(export, Path(work), settings, sys.stderr)
        prompts = [held_out_prompt(sample) for sample in held_out]
        figures = sglang_eagle3_acceptance(target, draft, prompts, settings, args.url, launch, args.server_log)
    write_json(args.out, figures)


if __name__ == "__main__":
    cli.run(main)
