#!/usr/bin/env python
"""Regenerate the assistant turns of one prompt shard with the configured backend."""

from eagle3_datagen import cli
from eagle3_datagen.responses import run_responses


def make_backend(settings: dict):
    model = settings["model"]
    backend = settings["backend"]
    if backend == "hf":
        from eagle3_datagen.backends.hf import HFBackend

        return HFBackend(model["path"], settings["sampling"], settings["hf"], model)
    raise SystemExit(
        f"inference backend {backend!r} is not available in this version; use `hf` "
        "(the SGLang and OpenRouter backends are tracked in the production-generation issue)"
    )


def main() -> None:
    p = cli.parser(__doc__)
    p.add_argument("--prompts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--stats", required=True)
    args = p.parse_args()
    cli.setup(args)
    run_responses(args.prompts, args.out, args.stats, make_backend(args.settings))


if __name__ == "__main__":
    main()
