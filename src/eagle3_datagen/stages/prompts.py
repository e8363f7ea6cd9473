"""Stage 1: raw chat records in their own format -> normalized, deduplicated prompts.

A prompt keeps the system message and the user turns of a conversation; the original
assistant turns are dropped because the target model regenerates them. Tool conversations
keep their declared tools and their recorded calls and results in OpenAI layout, with
Kimi's call ids: generation compares the regenerated calls with them and reuses the
results of those that match (docs/formats.md).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from eagle3_datagen.formats.datasets import normalize
from eagle3_datagen.formats.files import iter_jsonl, write_json, write_jsonl_zst

# Stats keys `prefix:name` that are gathered into one {name: count} table each.
TABLES = {"ignored_field": "ignored_fields", "ignored_turn_field": "ignored_turn_fields"}


def shard_of(prompt_id: str, shards: int) -> int:
    return int(prompt_id, 16) % shards


def prompt_ids(shard_paths: Iterable[str | Path]) -> set[str]:
    """The ids of the prompts in written shards (an earlier partition's)."""
    return {prompt["id"] for path in shard_paths for _, prompt in iter_jsonl(path)}


def build_prompts(
    source: str | Path,
    fmt: str,
    shard_paths: Sequence[str | Path],
    stats_path: str | Path,
    system_prompt: str | None = None,
    max_prompts: int | None = None,
    max_bad_record_rate: float = 0.0,
    earlier_shards: Sequence[str | Path] = (),
) -> dict:
    """Normalize, deduplicate and shard one partition's source. Returns the stats written.

    Prompts already in `earlier_shards` (the earlier partitions', when the config drops prompts
    shared across partitions) are left out and counted. Nothing is written unless the whole source
    was read within `max_bad_record_rate`.
    """
    stats: Counter = Counter()
    bad_examples: list[dict] = []
    seen: set[str] = set()
    earlier = prompt_ids(earlier_shards)
    shards: list[list[dict]] = [[] for _ in shard_paths]
    for prompt in normalize(source, fmt, system_prompt, stats, max_bad_record_rate, bad_examples):
        if prompt["id"] in seen:
            stats["duplicates"] += 1
            continue
        if prompt["id"] in earlier:
            stats["shared_with_earlier_partitions"] += 1
            continue
        if max_prompts is not None and len(seen) >= max_prompts:
            stats["over_max_prompts"] += 1
            continue
        seen.add(prompt["id"])
        shards[shard_of(prompt["id"], len(shard_paths))].append(prompt)
    for path, rows in zip(shard_paths, shards, strict=True):
        write_jsonl_zst(path, rows)
    prompts = [p for rows in shards for p in rows]
    counts = {k: v for k, v in stats.items() if k.partition(":")[0] not in TABLES}
    result = {
        "source": str(source),
        "format": fmt,
        "prompts": len(seen),
        "per_shard": [len(rows) for rows in shards],
        "multi_turn": sum(1 for p in prompts if _user_turns(p) > 1),
        "with_tools": sum(1 for p in prompts if p.get("tools")),
        "recorded_tool_calls": sum(len(m.get("tool_calls") or ()) for p in prompts for m in p["messages"]),
        "recorded_tool_results": sum(1 for p in prompts for m in p["messages"] if m["role"] == "tool"),
        **dict(sorted(counts.items())),
        **{table: _table(stats, prefix) for prefix, table in TABLES.items()},
    }
    if bad_examples:
        result["bad_record_examples"] = bad_examples
    write_json(stats_path, result)
    return result


def _table(stats: Counter, prefix: str) -> dict:
    return dict(sorted((k.partition(":")[2], v) for k, v in stats.items() if k.partition(":")[0] == prefix))


def _user_turns(prompt: dict) -> int:
    return sum(1 for m in prompt["messages"] if m["role"] == "user")
