#!/usr/bin/env python
"""Rebuild input_ids + loss mask for one response shard and audit them against server IDs."""

from eagle3_datagen import cli
from eagle3_datagen.chat.template import TemplateError
from eagle3_datagen.stages.tokens import TokenSettings, run_tokens
from eagle3_datagen.stages.tokens.audit import AuditFailure


def main() -> None:
    p = cli.parser(__doc__)
    p.add_argument("--responses", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--audit", required=True)
    args = p.parse_args()
    cli.setup(args)
    model = args.settings["model"]
    settings = TokenSettings.from_config(args.settings["tokens"])
    run_tokens(args.responses, args.out, args.audit, model["path"], model, settings, workers=args.threads)


if __name__ == "__main__":
    cli.run(main, (TemplateError, AuditFailure))
