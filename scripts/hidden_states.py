#!/usr/bin/env python
"""Capture EAGLE-3 auxiliary and final hidden states for one token shard."""

from eagle3_datagen import cli
from eagle3_datagen.stages.hidden import run_hidden


def main() -> None:
    p = cli.parser(__doc__)
    p.add_argument("--tokens", required=True)
    p.add_argument("--out", required=True, help="shard directory to create")
    args = p.parse_args()
    cli.setup(args)
    model = args.settings["model"]
    run_hidden(args.tokens, args.out, model["path"], model, args.settings["hidden_states"])


if __name__ == "__main__":
    main()
