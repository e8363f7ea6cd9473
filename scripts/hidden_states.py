#!/usr/bin/env python
"""Capture EAGLE-3 auxiliary and final hidden states for one token shard.

With the sglang backend, the script runs itself again under torchrun, one tensor-parallel rank per GPU.
"""

from eagle3_datagen import cli
from eagle3_datagen.stages.hidden import run_hidden


def main() -> None:
    p = cli.parser(__doc__)
    p.add_argument("--tokens", required=True)
    p.add_argument("--out", required=True, help="shard directory to create")
    args = p.parse_args()
    cli.setup(args, "hidden_states")
    cli.relaunch_under_torchrun(args)
    model = args.settings["model"]
    run_hidden(args.tokens, args.out, model["path"], model, args.settings["hidden_states"])


if __name__ == "__main__":
    main()
