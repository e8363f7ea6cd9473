#!/usr/bin/env python
"""Capture EAGLE-3 auxiliary and final hidden states for one token shard.

The forward passes run in the node's capture runner (scripts/capture_runner.py), which the first
hidden-state job on the node starts and the later ones reuse: the model loads once per node and run.
Another copy of the same job (a restarted controller's) waits until this one is done.
"""

from pathlib import Path

from eagle3_datagen import cli
from eagle3_datagen.formats.shard_lease import one_copy
from eagle3_datagen.stages.hidden.runner import CaptureFailed, capture_with_runner

RUNNER = Path(__file__).resolve().with_name("capture_runner.py")


def main() -> None:
    p = cli.parser(__doc__)
    p.add_argument("--tokens", required=True)
    p.add_argument("--out", required=True, help="shard directory to create")
    args = p.parse_args()
    cli.setup(args, "hidden_states", torch_threads=False)  # the runner computes, with --threads
    with one_copy([args.out], [args.tokens]) as done:
        if not done:
            capture_with_runner(args.tokens, args.out, args.settings, args.threads, RUNNER)


if __name__ == "__main__":
    cli.run(main, (CaptureFailed,))
