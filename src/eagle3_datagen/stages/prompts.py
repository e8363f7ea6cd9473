"""Stage 1: raw chat records in their own format -> normalized, deduplicated prompts.

A prompt keeps the system message and the user turns of a conversation; the original
assistant turns are dropped because the target model regenerates them. Tool conversations
keep their declared tools and their recorded calls and results in OpenAI layout, with
Kimi's call ids: generation compares the regenerated calls with them and reuses the
results of those that match (docs/formats.md).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from eagle3_datagen.formats.datasets import normalize
from eagle3_datagen.formats.files import write_json, write_jsonl_zst


def shard_of(prompt_id: str, shards: int) -> int:
    return int(prompt_id, 16) % shards


def build_prompts(
    source: str | Path,
    fmt: str,
    shard_paths: Sequence[str | Path],
    stats_path: str | Path,
    system_prompt: str | None = None,
    max_prompts: int | None = None,
) -> dict:
    """Normalize, deduplicate and shard one partition's source. Returns the stats written."""
    stats: Counter = Counter()
    seen: set[str] = set()
    shards: list[list[dict]] = [[] for _ in shard_paths]
    for prompt in normalize(source, fmt, system_prompt, stats):
        if prompt["id"] in seen:
            stats["duplicates"] += 1
            continue
        if max_prompts is not None and len(seen) >= max_prompts:
            stats["over_max_prompts"] += 1
            continue
        seen.add(prompt["id"])
        shards[shard_of(prompt["id"], len(shard_paths))].append(prompt)
    for path, rows in zip(shard_paths, shards, strict=True):
        write_jsonl_zst(path, rows)
    result = {
        "source": str(source),
        "format": fmt,
        "prompts": len(seen),
        "per_shard": [len(rows) for rows in shards],
        "multi_turn": sum(1 for rows in shards for p in rows if _user_turns(p) > 1),
        "with_tools": sum(1 for rows in shards for p in rows if p.get("tools")),
        "recorded_tool_calls": sum(
            len(m.get("tool_calls") or ()) for rows in shards for p in rows for m in p["messages"]
        ),
        **dict(sorted(stats.items())),
    }
    write_json(stats_path, result)
    return result


def _user_turns(prompt: dict) -> int:
    return sum(1 for m in prompt["messages"] if m["role"] == "user")
