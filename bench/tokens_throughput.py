#!/usr/bin/env python
"""Throughput of the tokens stage on Kimi-K2.5's real tokenizer, slow and fast.

Generates multi-turn conversations (words, code and CJK text, with reasoning; one in five a
tool-call chain with its tools declared) and runs the tokens stage's builder on them with
Kimi-K2.5's real tokenizer files and chat template (`resources/kimi-k2.5`) four ways:
- slow: the model directory's remote-code slow tokenizer (the project's own over `tiktoken`,
  standing in for Moonshot's `TikTokenTokenizer`), boundaries by re-encoding each prompt prefix;
- slow model, fast encoder: what the stage does for such a directory: the slow tokenizer renders,
  a fast one built from `tiktoken.model` encodes with offsets, every text checked against the slow;
- fast: a directory holding that fast tokenizer (tokenizer.json), 1 process and --workers processes.
All four must give identical samples. Then slow and fast by conversation length. First, the quality
gates' cost per row (every gate on; the timed builds run with the repetition gate off, see below).

Usage: python bench/tokens_throughput.py [--conversations 2000] [--workers 2] [--per-length 100]
Run from the repository root with the project's venv on PATH.
"""

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from eagle3_datagen.chat.gates import GateMarkers, Gates, GateSettings
from eagle3_datagen.chat.template import load_tokenizer, resolve_special_tokens
from eagle3_datagen.chat.tiktoken_fast import fast_tokenizer_from_tiktoken
from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.stages.tokens import TokenBuilder, TokenSettings, build_samples, make_builder

REPO = Path(__file__).resolve().parents[1]
KIMI = REPO / "resources" / "kimi-k2.5"
WORDS = [
    *("the model writes a function that returns sorted values from each list and checks every edge case",),
    *("before it answers with short code examples explained in plain words for the user",),
]
WORDS = " ".join(WORDS).split(" ")
CODE = "def merge(a, b):\n    out = []\n    while a and b:\n        out.append(a.pop(0) if a[0] < b[0] else b.pop(0))\n"
CJK = "这个函数返回排序后的列表。"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search_code",
            "description": "Search the repository for a pattern.",
            "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}}, "required": ["pattern"]},
        },
    }
]


def text(rng: random.Random, words: int) -> str:
    parts = [" ".join(rng.choices(WORDS, k=words))]
    if rng.random() < 0.3:
        parts.append(CODE * rng.randint(1, 3))
    if rng.random() < 0.1:
        parts.append(CJK)
    return "\n\n".join(parts)


def answer(rng: random.Random, turn: int, **extra) -> dict:
    return {
        "role": "assistant",
        "content": text(rng, rng.randint(30, 150)),
        "reasoning": text(rng, rng.randint(10, 60)),
        "finish_reason": "stop",
        "turn": turn,
        **extra,
    }


def conversation(rng: random.Random, index: int, turns: int) -> dict:
    messages = [{"role": "system", "content": "You are a careful assistant."}] if index % 2 else []
    with_tools = index % 5 == 0
    for turn in range(turns):
        messages.append({"role": "user", "content": text(rng, rng.randint(8, 40))})
        if with_tools:
            call_id = "functions.search_code:0"
            arguments = json.dumps({"pattern": rng.choice(WORDS)})
            call = {"id": call_id, "type": "function", "function": {"name": "search_code", "arguments": arguments}}
            messages.append({**answer(rng, turn, tool_calls=[call], finish_reason="tool_calls"), "content": ""})
            messages.append({"role": "tool", "tool_call_id": call_id, "name": "search_code", "content": CODE})
        messages.append(answer(rng, turn))
    row = {"id": f"c{index}", "messages": messages, "status": "ok"}
    return {**row, "tools": TOOLS} if with_tools else row


def conversations(n: int, seed: int, turns: int | None = None) -> list[dict]:
    rng = random.Random(seed)
    return [conversation(rng, i, turns or rng.choice((1, 1, 2, 3, 4, 6, 8))) for i in range(n)]


def gate_cost(rows: list[dict], tokenizer) -> None:
    """The quality gates' time per row, every gate on (the repetition gate's loop share is most of it)."""
    gates = Gates(
        GateSettings.from_config(fill_defaults({}, "tokens.gates")),
        GateMarkers.of(tokenizer, resolve_special_tokens(tokenizer)),
    )
    chars = sum(
        len(m.get("content") or "") + len(m.get("reasoning") or "")
        for r in rows
        for m in r["messages"]
        if m["role"] == "assistant"
    )
    start = time.perf_counter()
    dropped = sum(bool(gates.reasons(row)) for row in rows)
    seconds = time.perf_counter() - start
    print(
        f"quality gates: {seconds / len(rows) * 1e3:.3f} ms per row ({chars / len(rows):.0f} characters of "
        f"reasoning and content), {dropped} of {len(rows)} rows dropped\n",
        flush=True,
    )


def timed(label: str, run) -> tuple[float, list[dict]]:
    start = time.perf_counter()
    samples = run()
    seconds = time.perf_counter() - start
    tokens = sum(len(s["input_ids"]) for s in samples)
    rates = f"{len(samples) / seconds:.0f} | {tokens / seconds:.0f}"
    print(f"| {label} | {len(samples)} | {tokens} | {seconds:.1f} | {rates} |", flush=True)
    return seconds, samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=2000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--per-length", type=int, default=100, help="conversations per length in the scaling table")
    args = p.parse_args()
    sys.path.insert(0, str(REPO))  # the remote-code slow tokenizer is a test double, in tests/doubles
    from tests.doubles.tiktoken_slow import write_remote_code_dir

    # The synthetic answers repeat a code block verbatim, which the repetition gate takes for a loop in 7% of
    # the rows: off, so that every row is encoded, as in the measurements before the gates.
    no_loops = {"repetition": {"enabled": False}}
    settings = TokenSettings.from_config(fill_defaults({"max_length": 1 << 20, "gates": no_loops}, "tokens"))
    with tempfile.TemporaryDirectory() as tmp:
        slow_dir = write_remote_code_dir(KIMI, Path(tmp) / "remote")
        fast_dir = Path(tmp) / "fast"
        fast_tokenizer_from_tiktoken(KIMI).save_pretrained(fast_dir)
        slow = load_tokenizer(slow_dir, trust_remote_code=True)
        fast = load_tokenizer(fast_dir)
        checked = make_builder(slow_dir, fill_defaults({"trust_remote_code": True}, "model"), settings)

        def builder(tokenizer) -> TokenBuilder:
            return TokenBuilder(tokenizer, resolve_special_tokens(tokenizer), settings)

        rows = conversations(args.conversations, seed=0)
        print(f"{len(rows)} conversations, {sum(1 for r in rows if 'tools' in r)} with tool calls\n")
        gate_cost(rows, fast)
        print("| tokenizer | samples | tokens | seconds | samples/s | tokens/s |")
        print("|---|---|---|---|---|---|")
        slow_s, by_slow = timed("slow (remote code), prefix re-encoding", lambda: builder(slow).samples_for_rows(rows))
        _, by_checked = timed("slow model, fast encoder checked against it", lambda: checked.samples_for_rows(rows))
        fast_s, by_fast = timed("fast, offsets, 1 process", lambda: builder(fast).samples_for_rows(rows))
        timed(
            f"fast, offsets, {args.workers} processes",
            lambda: build_samples(rows, fast_dir, fill_defaults({}, "model"), settings, workers=args.workers)[0],
        )
        if not by_slow == by_checked == by_fast:
            raise SystemExit("the tokenizers disagree")
        print(f"\nfast / slow samples/s: {slow_s / fast_s:.2f}\n")

        print("| assistant turns | tokens per sample | fast samples/s | slow samples/s | fast / slow |")
        print("|---|---|---|---|---|")
        # Builders made once, outside the timings (a fast tokenizer's vocabulary lookups at setup
        # take most of a second).
        fast_builder, slow_builder = builder(fast), builder(slow)
        for turns in (1, 2, 4, 8):
            subset = conversations(args.per_length, seed=turns, turns=turns)
            start = time.perf_counter()
            samples = fast_builder.samples_for_rows(subset)
            fast_s = time.perf_counter() - start
            start = time.perf_counter()
            slow_builder.samples_for_rows(subset)
            slow_s = time.perf_counter() - start
            mean_tokens = sum(len(s["input_ids"]) for s in samples) / len(samples)
            rates = f"{len(subset) / fast_s:.0f} | {len(subset) / slow_s:.0f} | {slow_s / fast_s:.2f}"
            print(f"| {turns} | {mean_tokens:.0f} | {rates} |", flush=True)


if __name__ == "__main__":
    main()
