#!/usr/bin/env python
"""Train a draft on a partition's SpecForge export with SpecForge 0.2.0's release and measure its acceptance
length by speculative decoding of the target on held-out samples; fail below a minimum, keeping the data.

Runs under SpecForge's venv (`make specforge-env`), on the CPU."""

import json
import logging
from pathlib import Path

from eagle3_datagen import cli
from eagle3_datagen.formats.files import read_jsonl, write_json
from eagle3_datagen.stages.evaluate.measure import evaluate_partition
from eagle3_datagen.stages.evaluate.speculative import AcceptanceTooLow, check_acceptance


def main() -> None:
    p = cli.parser(__doc__, stage_settings=False)
    p.add_argument("--partition", required=True)
    p.add_argument("--export", required=True, help="the partition's SpecForge export directory (training data)")
    p.add_argument("--held-out", nargs="+", required=True, help="token files (jsonl.zst) of the held-out samples")
    p.add_argument(
        "--settings",
        required=True,
        type=json.loads,
        help="JSON: train_steps, seed, batch_size, learning_rate, "
        "spec_steps, ttt_length, max_new_tokens, min_acceptance_length",
    )
    p.add_argument("--work", required=True, help="directory for SpecForge's run (checkpoint, cache)")
    p.add_argument("--out", required=True, help="the figures (JSON)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    settings = args.settings
    held_out = [row for path in args.held_out for row in read_jsonl(path)]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    figures = evaluate_partition(Path(args.export), held_out, work, settings, work / "specforge.log")
    figures["partition"] = args.partition
    write_json(args.out, figures)
    logging.getLogger("evaluate").info("%s: acceptance length %.3f", args.partition, figures["acceptance_length"])
    check_acceptance(args.partition, figures["acceptance_length"], settings["min_acceptance_length"])


if __name__ == "__main__":
    cli.run(main, (AcceptanceTooLow,))
