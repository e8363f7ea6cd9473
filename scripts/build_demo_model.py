#!/usr/bin/env python
"""Build the embedded demo's tiny target model (Qwen3 tokenizer, fitted tiny Qwen3 LM)."""

from eagle3_datagen import cli
from eagle3_datagen.demo import build_demo_model, training_conversations


def main() -> None:
    p = cli.parser(__doc__)
    p.add_argument(
        "--source",
        nargs=2,
        action="append",
        metavar=("PATH", "FORMAT"),
        required=True,
        help="a demo data source and its format; repeatable",
    )
    p.add_argument("--out", required=True, help="model directory to write")
    args = p.parse_args()
    cli.setup(args)
    facts = build_demo_model(training_conversations(args.source), args.out, args.settings)
    print(facts)


if __name__ == "__main__":
    main()
