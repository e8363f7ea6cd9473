#!/usr/bin/env python
"""Export hidden-state shards to SpecForge's or vLLM speculators' training layout."""

import argparse
import logging

from eagle3_datagen.stages.export import FORMATS, export


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--format", choices=FORMATS, required=True)
    p.add_argument("--hidden", nargs="+", required=True, help="hidden-state shard directories, in order")
    p.add_argument("--out", required=True, help="directory to create")
    p.add_argument("--vocab", help="the vocab stage's directory (d2t.npy, t2d.npy), named in the speculators command")
    p.add_argument("--draft-vocab-size", type=int, help="entries of that d2t.npy")
    p.add_argument("--model", help="the verifier model directory, named in the speculators training command")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    logging.getLogger("export").info(
        "%s", export(args.hidden, args.out, args.format, args.vocab, args.model, args.draft_vocab_size)
    )


if __name__ == "__main__":
    main()
