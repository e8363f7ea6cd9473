#!/usr/bin/env python
"""Build a demo's tiny target model, fitted to its partitions: Qwen3 (the embedded demo), Kimi (DeepSeek-V3), or a
target family's architecture with its real tokenizer (docs/targets.md)."""

import json

from eagle3_datagen import cli
from eagle3_datagen.targets import build_target


def main() -> None:
    p = cli.parser(__doc__)
    p.add_argument(
        "--partitions",
        required=True,
        type=json.loads,
        help='the partitions to fit to, as JSON: [{"source", "format"[, "system_prompt"]}, ...]',
    )
    p.add_argument("--out", required=True, help="model directory to write")
    args = p.parse_args()
    cli.setup(args)
    print(build_target(args.partitions, args.out, args.settings))


if __name__ == "__main__":
    cli.run(main)
