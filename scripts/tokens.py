#!/usr/bin/env python
"""Rebuild input_ids + loss mask for one response shard, drop the rows its quality gates fail, and audit
the IDs against server IDs. Prints each gate's count for the shard, and for its partition's finished
shards, on the console (`note: gates: ...`)."""

from pathlib import Path

from eagle3_datagen import cli
from eagle3_datagen.chat.gates import console_line
from eagle3_datagen.chat.template import TemplateError
from eagle3_datagen.stages.tokens import NothingTrained, TokenSettings, finished_gates, run_tokens
from eagle3_datagen.stages.tokens.audit import AuditFailure


def main() -> None:
    p = cli.parser(__doc__)
    p.add_argument("--responses", required=True)
    p.add_argument("--out", required=True, help="results/{partition}/tokens/{shard}.jsonl.zst")
    p.add_argument("--audit", required=True)
    args = p.parse_args()
    cli.setup(args)
    model = args.settings["model"]
    settings = TokenSettings.from_config(args.settings["tokens"])
    report = run_tokens(args.responses, args.out, args.audit, model["path"], model, settings, workers=args.threads)
    out = Path(args.out)
    partition, shard = out.parent.parent.name, out.name.split(".")[0]
    cli.console(console_line(f"{partition}/{shard}", report["gates"]))
    so_far = finished_gates(Path(args.audit).parent)
    finished = f"{so_far['shards']} shard{'s' if so_far['shards'] != 1 else ''} finished"
    cli.console(console_line(f"{partition} ({finished})", so_far))


if __name__ == "__main__":
    cli.run(main, (TemplateError, AuditFailure, NothingTrained))
