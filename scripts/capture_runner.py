#!/usr/bin/env python
"""The node's capture runner: load the target model once, then capture the shards that the node's
hidden-state jobs hand over, until its supervisor stops it.

Started by the first hidden-state job on a node (under torchrun, one rank per GPU, with the sglang
backend), never by hand; see eagle3_datagen.stages.hidden.runner.
"""

from eagle3_datagen import cli
from eagle3_datagen.stages.hidden.runner import serve


def main() -> None:
    p = cli.parser(__doc__)
    args = p.parse_args()
    cli.setup(args)
    serve(args.settings)


if __name__ == "__main__":
    cli.run(main)
