#!/usr/bin/env python
"""Throughput of the tokens stage: offset-mapped boundaries vs prefix re-encoding.

Generates multi-turn conversations (words, code and CJK text, with reasoning) and runs the
tokens stage's builder on them with the Kimi-K2.5-style tokenizer (Qwen's real BPE ranks,
Kimi's special tokens and template) three ways: boundaries from the tokenizer's offsets in
one process, the same in --workers processes, and boundaries by re-encoding the text up to
every boundary (the prefix approach). Then the same two boundary methods by conversation
length (turns per conversation).

Usage: python bench/tokens_throughput.py [--conversations 10000] [--workers 2] [--per-length 500]
Run from the repository root with the project's venv on PATH.
"""

import argparse
import random
import tempfile
import time

from eagle3_datagen.chat import load_tokenizer, resolve_special_tokens
from eagle3_datagen.kimi_style import write_kimi_style_tokenizer
from eagle3_datagen.tokens import TokenBuilder, TokenSettings, build_samples

WORDS = [
    *("the model writes a function that returns sorted values from each list and checks every edge case",),
    *("before it answers with short code examples explained in plain words for the user",),
]
WORDS = " ".join(WORDS).split(" ")
CODE = "def merge(a, b):\n    out = []\n    while a and b:\n        out.append(a.pop(0) if a[0] < b[0] else b.pop(0))\n"
CJK = "这个函数返回排序后的列表。"


def text(rng: random.Random, words: int) -> str:
    parts = [" ".join(rng.choices(WORDS, k=words))]
    if rng.random() < 0.3:
        parts.append(CODE * rng.randint(1, 3))
    if rng.random() < 0.1:
        parts.append(CJK)
    return "\n\n".join(parts)


def conversation(rng: random.Random, index: int, turns: int) -> dict:
    messages = [{"role": "system", "content": "You are a careful assistant."}] if index % 2 else []
    for turn in range(turns):
        messages.append({"role": "user", "content": text(rng, rng.randint(8, 40))})
        messages.append(
            {
                "role": "assistant",
                "content": text(rng, rng.randint(30, 150)),
                "reasoning": text(rng, rng.randint(10, 60)),
                "finish_reason": "stop",
                "turn": turn,
            }
        )
    return {"id": f"c{index}", "messages": messages, "status": "ok"}


def conversations(n: int, seed: int, turns: int | None = None) -> list[dict]:
    rng = random.Random(seed)
    return [conversation(rng, i, turns or rng.choice((1, 1, 2, 3, 4, 6, 8))) for i in range(n)]


def timed(label: str, run) -> tuple[float, list[dict]]:
    start = time.perf_counter()
    samples = run()
    seconds = time.perf_counter() - start
    tokens = sum(len(s["input_ids"]) for s in samples)
    rates = f"{len(samples) / seconds:.0f} | {tokens / seconds:.0f}"
    print(f"| {label} | {len(samples)} | {tokens} | {seconds:.1f} | {rates} |")
    return seconds, samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=10000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--per-length", type=int, default=500, help="conversations per length in the scaling table")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_kimi_style_tokenizer(tmp)
        tokenizer = load_tokenizer(model_dir)
        specials = resolve_special_tokens(tokenizer)
        settings = TokenSettings(max_length=1 << 20)

        def builder(boundaries: str) -> TokenBuilder:
            return TokenBuilder(tokenizer, specials, settings, boundaries=boundaries)

        rows = conversations(args.conversations, seed=0)
        print(f"{len(rows)} conversations, {sum(len(r['messages']) // 2 for r in rows)} assistant turns\n")
        print("| method | samples | tokens | seconds | samples/s | tokens/s |")
        print("|---|---|---|---|---|---|")
        offsets_s, by_offsets = timed("offsets, 1 process", lambda: builder("offsets").samples_for_rows(rows))
        timed(
            f"offsets, {args.workers} processes",
            lambda: build_samples(rows, model_dir, {}, settings, workers=args.workers)[0],
        )
        prefix_s, by_prefix = timed("prefix re-encoding, 1 process", lambda: builder("prefix").samples_for_rows(rows))
        if by_offsets != by_prefix:
            raise SystemExit("the two boundary methods disagree")
        print(f"\nprefix / offsets time ratio: {prefix_s / offsets_s:.2f}\n")

        print("| turns | tokens per sample | offsets samples/s | prefix samples/s | ratio |")
        print("|---|---|---|---|---|")
        for turns in (1, 2, 4, 8, 16):
            subset = conversations(args.per_length, seed=turns, turns=turns)
            start = time.perf_counter()
            samples = builder("offsets").samples_for_rows(subset)
            fast = time.perf_counter() - start
            start = time.perf_counter()
            builder("prefix").samples_for_rows(subset)
            slow = time.perf_counter() - start
            mean_tokens = sum(len(s["input_ids"]) for s in samples) / len(samples)
            rates = f"{len(subset) / fast:.0f} | {len(subset) / slow:.0f} | {slow / fast:.2f}"
            print(f"| {turns} | {mean_tokens:.0f} | {rates} |")


if __name__ == "__main__":
    main()
