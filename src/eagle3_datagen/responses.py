"""Stage 2: the target model regenerates every assistant turn of each prompt.

A backend answers one batch of conversations at a time (`Backend.generate`). This module
owns the multi-turn loop: the assistant turn after each user turn is generated in order,
on the regenerated history, and a conversation stops at its first truncated or malformed
turn.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from .histograms import histogram
from .io import read_jsonl, write_json, write_jsonl_zst

log = logging.getLogger(__name__)


@dataclass
class Turn:
    """One generated assistant turn as a backend returns it."""

    content: str
    reasoning: str
    finish_reason: str  # "stop" | "length"
    usage: dict
    output_ids: list[int] | None = None
    malformed: str | None = None  # why the output cannot be rendered back, e.g. "think_block"
    extra: dict = field(default_factory=dict)

    def as_message(self, turn_index: int) -> dict:
        message = {
            "role": "assistant",
            "content": self.content,
            "reasoning": self.reasoning,
            "finish_reason": self.finish_reason,
            "usage": self.usage,
            "turn": turn_index,
            **self.extra,
        }
        if self.output_ids is not None:
            message["output_ids"] = self.output_ids
        if self.malformed:
            message["malformed"] = self.malformed
        return message

    @property
    def status(self) -> str:
        if self.finish_reason != "stop":
            return "truncated"
        return "malformed" if self.malformed else "ok"


class Backend(Protocol):
    name: str
    model: str

    def generate(self, conversations: Sequence[list[dict]]) -> list[Turn]:
        """Generate the next assistant turn for each conversation (each ends with a user turn)."""
        ...


def interleave(prompt_messages: list[dict], replies: list[dict]) -> list[dict]:
    """System and user turns with the i-th reply after the i-th user turn.

    Stops after the first user turn that has no reply: that is the turn to generate next,
    or, in a finished row, the turn never reached because an earlier one was truncated.
    """
    messages, pending = [], iter(replies)
    for message in prompt_messages:
        messages.append(message)
        if message["role"] == "user":
            reply = next(pending, None)
            if reply is None:
                break
            messages.append(reply)
    return messages


def through_last_reply(messages: list[dict]) -> list[dict]:
    """`messages` cut after their last assistant turn (a row ends with what was generated)."""
    while messages and messages[-1]["role"] != "assistant":
        messages = messages[:-1]
    return messages


def regenerate(prompts: list[dict], backend: Backend) -> list[dict]:
    """Regenerate all assistant turns of `prompts`; returns response rows in prompt order."""
    replies: dict[str, list[dict]] = {p["id"]: [] for p in prompts}
    status = {p["id"]: "ok" for p in prompts}
    user_turns = {p["id"]: sum(m["role"] == "user" for m in p["messages"]) for p in prompts}
    for turn_index in range(max(user_turns.values(), default=0)):
        pending = [p for p in prompts if status[p["id"]] == "ok" and user_turns[p["id"]] > turn_index]
        if not pending:
            break
        log.info("user turn %d: generating %d responses", turn_index + 1, len(pending))
        histories = [interleave(p["messages"], replies[p["id"]]) for p in pending]
        for prompt, turn in zip(pending, backend.generate(histories), strict=True):
            replies[prompt["id"]].append(turn.as_message(turn_index))
            status[prompt["id"]] = turn.status
    return [
        {
            "id": p["id"],
            "messages": through_last_reply(interleave(p["messages"], replies[p["id"]])),
            "source": p["source"],
            "backend": backend.name,
            "model": backend.model,
            "status": status[p["id"]],
        }
        for p in prompts
    ]


def regenerated_turns(rows: list[dict]) -> list[dict]:
    return [m for r in rows for m in r["messages"] if m["role"] == "assistant"]


def response_stats(rows: list[dict]) -> dict:
    turns = regenerated_turns(rows)
    finish = Counter(m["finish_reason"] for m in turns)
    usage = Counter()
    for message in turns:
        usage.update({k: v for k, v in message["usage"].items() if isinstance(v, int | float)})
    return {
        "prompts": len(rows),
        "status": dict(Counter(r["status"] for r in rows)),
        "finish_reasons": dict(finish),
        "assistant_turns": len(turns),
        "usage": dict(usage),
        # Per regenerated turn; reasoning in characters, since text-only backends return no token count for it.
        "lengths": {
            "prompt_tokens": histogram(m["usage"].get("prompt_tokens", 0) for m in turns),
            "completion_tokens": histogram(m["usage"].get("completion_tokens", 0) for m in turns),
            "reasoning_chars": histogram(len(m.get("reasoning") or "") for m in turns),
        },
    }


def throughput(rows: list[dict], seconds: float) -> dict:
    """What one job generated and how long it took (rows journalled by an earlier job excluded)."""
    tokens = sum(m["usage"].get("completion_tokens", 0) for m in regenerated_turns(rows))
    return {"seconds": round(seconds, 3), "prompts": len(rows), "completion_tokens": tokens}


def run_responses(prompts_path: str | Path, out_path: str | Path, stats_path: str | Path, backend: Backend) -> dict:
    prompts = read_jsonl(prompts_path)
    started = time.monotonic()
    rows = regenerate(prompts, backend)
    write_jsonl_zst(out_path, rows)
    stats = {"backend": backend.name, "model": backend.model, **response_stats(rows)}
    stats["throughput"] = throughput(rows, time.monotonic() - started)
    write_json(stats_path, stats)
    return stats
