#!/usr/bin/env python
"""Build a demo's tiny target model, fitted to its partitions: Qwen3 (the embedded demo) or Kimi (DeepSeek-V3)."""

import json

from eagle3_datagen import cli
from eagle3_datagen.targets.demo import build_demo_model, training_conversations


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
    if args.settings.get("architecture") == "deepseek_v3":  # absent: the Qwen3 demo
        from eagle3_datagen.targets.tiny_kimi import build_tiny_kimi

        facts = build_tiny_kimi(args.partitions, args.out, args.settings)
    else:
        sources = [(part["source"], part["format"]) for part in args.partitions]
        facts = build_demo_model(training_conversations(sources), args.out, args.settings)
    print(facts)


if __name__ == "__main__":
    cli.run(main)
