#!/usr/bin/env python
"""Train a draft on SpecForge exports (a partition's, or every partition's together) with SpecForge 0.2.0's
release and measure its acceptance length by speculative decoding of the target on the held-out samples;
fail below `min_acceptance_length`, keeping the data. With `--baseline-export`, train the same draft on the
baseline's export too and measure both on the same held-out samples. With `--vocab`, the drafts train with
that draft vocabulary rather than the one the export names (a partition's own: tests/workflow/test_workflow.py).

Runs under SpecForge's venv (`make specforge-env`); the training on the CPU, or on one GPU with
evaluate.device: cuda; the decoding on the CPU. With `--fraction` below 1, a point of the data curve: the
drafts train on that nested fraction of the samples (the baseline's on the same prompts' samples), no draft
is kept and no quick fail applies (a small fraction's draft may well fall below it)."""

import logging
import shutil
import sys
import tempfile
from pathlib import Path

from eagle3_datagen import cli
from eagle3_datagen.formats.files import atomic_dir, read_jsonl, write_json
from eagle3_datagen.formats.holdout import read_holdout
from eagle3_datagen.paired_acceptance import paired_comparison, prompt_figures
from eagle3_datagen.stages.evaluate.measure import evaluate_partition, held_out_samples
from eagle3_datagen.stages.evaluate.speculative import AcceptanceTooLow, check_acceptance


def main() -> None:
    p = cli.parser(__doc__)
    p.add_argument("--partition", required=True, help="the partition's name (`all`: every partition together)")
    p.add_argument("--export", nargs="+", required=True, help="SpecForge export directories (the training data)")
    p.add_argument("--tokens", nargs="+", required=True, help="token shards (jsonl.zst) holding the held-out samples")
    p.add_argument("--holdout", nargs="+", required=True, help="holdout files: the held-out prompt ids")
    p.add_argument("--baseline-export", nargs="*", default=[], help="the baseline's SpecForge exports, if any")
    p.add_argument(
        "--vocab", nargs="?", help="the draft vocabulary directory the drafts train with (default: the export's)"
    )
    p.add_argument("--fraction", type=float, default=1.0, help="the share of the samples the drafts train on")
    p.add_argument(
        "--draft", help="directory to create: the trained draft's SpecForge checkpoint (none kept if left out)"
    )
    p.add_argument("--out", required=True, help="the figures (JSON)")
    args = p.parse_args()
    cli.setup(args, "evaluate")
    log = logging.getLogger("evaluate")
    settings = args.settings
    ids = [i for path in args.holdout for i in read_holdout(path)]
    held_out = held_out_samples((row for path in args.tokens for row in read_jsonl(path)), ids)
    log.info("%s: %d held-out samples of %d held-out prompts", args.partition, len(held_out), len(ids))
    out = Path(args.out)
    with tempfile.TemporaryDirectory(prefix=".evaluate-", dir=out.parent) as work:
        work = Path(work)
        exports = [Path(e) for e in args.export]
        vocab = Path(args.vocab) if args.vocab else None
        figures, draft = evaluate_partition(
            exports, held_out, work / "draft", settings, sys.stderr, vocab, args.fraction
        )
        figures.update(partition=args.partition, exports=args.export, vocab=args.vocab, held_out_prompts=len(ids))
        if args.baseline_export:
            baseline_exports = [Path(e) for e in args.baseline_export]
            baseline, _ = evaluate_partition(
                baseline_exports, held_out, work / "baseline", settings, sys.stderr, vocab, args.fraction
            )
            # regenerated minus original, over the same held-out prompts (paired bootstrap)
            comparison = paired_comparison(
                prompt_figures(figures["per_prompt"]), prompt_figures(baseline["per_prompt"]), seed=settings["seed"]
            )
            figures["baseline"] = {**baseline, **comparison, "exports": args.baseline_export}
        if args.draft:
            with atomic_dir(args.draft) as tmp:
                shutil.copytree(draft, tmp, dirs_exist_ok=True)
    write_json(out, figures)
    log.info(
        "%s, %d samples: acceptance length %.3f %s",
        args.partition,
        figures["samples"],
        figures["acceptance_length"],
        figures["interval_95"],
    )
    if args.fraction < 1:
        return
    check_acceptance(args.partition, figures["acceptance_length"], settings["min_acceptance_length"])


if __name__ == "__main__":
    cli.run(main, (AcceptanceTooLow,))
