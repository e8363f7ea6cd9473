#!/usr/bin/env python
"""Probe one hidden-state shard with the target model's own LM head (top-1 agreement, log-probs)."""

from eagle3_datagen import cli
from eagle3_datagen.formats.files import read_json
from eagle3_datagen.stages.probe import ProbeFailure, ProbeSettings, run_probe


def main() -> None:
    p = cli.parser(__doc__)
    p.add_argument("--hidden", required=True, help="hidden-state shard directory")
    p.add_argument("--tokens-audit", required=True, help="the shard's tokens audit.json (what became of its rows)")
    p.add_argument("--partition", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    cli.setup(args, "probe")
    s = args.settings
    run_probe(
        args.hidden,
        args.out,
        s["model"]["path"],
        ProbeSettings.from_config(s["probe"]),
        partition=args.partition,
        backend=s["backend"],
        greedy_exact=s["greedy_exact"],
        tokens_audit=read_json(args.tokens_audit),
        device=s["probe"]["device"],
    )


if __name__ == "__main__":
    cli.run(main, (ProbeFailure,))
