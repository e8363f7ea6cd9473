#!/usr/bin/env python
"""Export hidden-state shards to SpecForge's or vLLM speculators' training layout, on --threads threads.

Where the shards were released (hidden_states.keep_shards: false), the export is rebuilt from its kept copy
(results/<partition>/hidden/kept/<format>: stages/export/kept.py) without reading any state.
"""

import json
import logging
from pathlib import Path

from eagle3_datagen import cli
from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.formats.files import reporting_full_disk
from eagle3_datagen.formats.hidden_shard import RELEASED
from eagle3_datagen.formats.holdout import read_holdout
from eagle3_datagen.formats.trainer_exports import EXPORTS
from eagle3_datagen.stages.export import export
from eagle3_datagen.stages.export.kept import kept_dir, rebuild


def main() -> None:
    p = cli.parser(__doc__, stage_settings=False)
    p.add_argument("--format", choices=EXPORTS.names(), required=True)
    p.add_argument("--hidden", nargs="+", required=True, help="hidden-state shard directories, in order")
    p.add_argument("--out", required=True, help="directory to create")
    p.add_argument("--model", help="the target (verifier) model directory: its final norm, LM head and config")
    p.add_argument("--vocab", help="the vocabulary stage's directory (d2t.npy, t2d.npy, vocab_mapping.pt), named")
    p.add_argument("--draft-vocab-size", type=int, help="the draft vocabulary's size (entries of that d2t.npy)")
    p.add_argument("--holdout", help="the evaluation's holdout file: its prompt ids are left out of the export")
    p.add_argument(
        "--settings",
        type=json.loads,
        default={},
        help="the config's `export` section as JSON (the rule passes it; default: the schema's defaults)",
    )
    p.add_argument("--threads", type=int, default=1, help="threads that read parts and write samples")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    import torch

    torch.set_num_threads(1)  # one sample per thread: the job's threads are the export's, not torch's
    released = [d for d in args.hidden if (Path(d) / RELEASED).exists()]
    if released and len(released) < len(args.hidden):
        raise ValueError(
            f"the shards {released} were released and the others were captured again: the export reads either "
            "every shard or its kept copy; delete the released ones too and rerun"
        )
    options = {
        "model_path": args.model,
        "vocab_dir": args.vocab,
        "draft_vocab_size": args.draft_vocab_size,
        "held_out": read_holdout(args.holdout) if args.holdout else (),
        "settings": fill_defaults(args.settings, "export"),
    }
    with reporting_full_disk(args.out):
        if released:
            summary = rebuild(kept_dir(args.out), args.hidden, args.out, args.format, **options)
        else:
            summary = export(args.hidden, args.out, args.format, threads=args.threads, **options)
    logging.getLogger("export").info("%s", summary)


if __name__ == "__main__":
    cli.run(main)
