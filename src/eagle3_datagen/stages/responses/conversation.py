"""Stage 2: the target model regenerates every assistant turn of each prompt.

This module owns the multi-turn loop's state (`Conversation`; `journaled` drives it against a
backend): the assistant turn after each user turn is generated in order, on the regenerated
history, and a conversation stops at its first truncated or malformed turn. A turn that calls
tools goes on only where the prompt recorded the same calls at that point: their recorded
results are appended and the model answers again; otherwise the conversation ends at that
call, with the reason counted. It also sums the rows into the shard's stats.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from eagle3_datagen.backends.base import Turn
from eagle3_datagen.chat.tool_calls import same_call
from eagle3_datagen.formats.histograms import histogram
from eagle3_datagen.formats.spend import Spend

TOOL_COUNTS = ("regenerated", "matched", "diverged", "results_reused", "recorded_not_called")


@dataclass
class _Step:
    """A recorded assistant turn's calls and the results recorded for them (by call id)."""

    calls: list[dict]
    results: dict[str, dict] = field(default_factory=dict)


class Conversation:
    """One prompt regenerated turn by turn.

    The prompt's system and user turns are sent in order; after each user turn the model
    answers. The recorded tool-call turns after a user turn form a chain: a regenerated turn
    whose calls equal the next recorded ones (same functions, arguments equal as JSON) gets
    their recorded results, its own call ids in `tool_call_id`, and the model answers again.
    A turn whose calls differ, or come where nothing was recorded, or lack a recorded result,
    ends the conversation (`ended`). A plain answer moves on to the next user turn.
    """

    def __init__(self, prompt: dict):
        self.prompt = prompt
        self.tools = prompt.get("tools")
        self.messages: list[dict] = []
        self.status = "ok"
        self.ended: str | None = None
        self.error: str | None = None
        self.failure: str | None = None  # a failed prompt's short reason (`RequestFailed.kind`, retries_exhausted)
        self.refused = False  # the provider refused the prompt itself: a rerun asks again at most once more
        self.lost = Spend()
        self.counts: Counter = Counter()
        self._turns = 0
        self._segments: deque[tuple[list[dict], list[_Step]]] = deque()
        leading: list[dict] = []
        for message in prompt["messages"]:
            if message["role"] == "user":
                self._segments.append(([*leading, message], []))
                leading = []
            elif message.get("tool_calls"):
                self._segments[-1][1].append(_Step(message["tool_calls"]))
            elif message["role"] == "tool":
                self._segments[-1][1][-1].results[message["tool_call_id"]] = message
            else:
                leading.append(message)
        self._chain: list[_Step] = []
        self.done = False
        self._next_user_turn()

    def _next_user_turn(self) -> None:
        if self._chain:
            self.counts["recorded_not_called"] += sum(len(step.calls) for step in self._chain)
        if not self._segments:
            self.done = True
            return
        messages, self._chain = self._segments.popleft()
        self.messages.extend(messages)

    def _end(self, reason: str) -> None:
        self.ended, self.done = reason, True

    def fail(self, error: str, failure: str, lost: Spend, refused: bool = False) -> None:
        """The prompt failed: `error` in the provider's words, `failure` its short reason, `lost` what its
        failed requests were billed; `refused`: the provider refuses the prompt itself."""
        self.status, self.error, self.done = "failed", error, True
        self.failure, self.lost, self.refused = failure, lost, refused

    def add(self, turn: Turn) -> None:
        """Record the model's answer to `self.messages` and move to what it asks for next."""
        self.messages.append(turn.as_message(self._turns))
        self._turns += 1
        if turn.status != "ok":
            self.status, self.done = turn.status, True
            return
        calls = turn.tool_calls or []
        if not calls:
            self._next_user_turn()
            return
        self.counts["regenerated"] += len(calls)
        if not self._chain:
            self.counts["diverged"] += len(calls)
            self._end("tool_call_unrecorded")
            return
        step = self._chain.pop(0)
        unused = list(step.calls)
        twins = []
        for call in calls:
            twin = next((r for r in unused if same_call(call, r)), None)
            if twin is not None:
                unused.remove(twin)
            twins.append(twin)
        matched = sum(t is not None for t in twins)
        self.counts["matched"] += matched
        self.counts["diverged"] += len(calls) - matched
        if matched < len(calls) or unused:
            self._end("tool_call_diverged")
            return
        results = [step.results.get(twin["id"]) for twin in twins]
        if None in results:
            self._end("tool_result_missing")
            return
        for call, result in zip(calls, results, strict=True):
            self.messages.append({**result, "tool_call_id": call["id"], "name": call["function"]["name"]})
        self.counts["results_reused"] += len(results)

    def row(self, backend: str, model: str) -> dict:
        row = {
            "id": self.prompt["id"],
            "messages": through_last_reply(self.messages),
            "source": self.prompt["source"],
            "backend": backend,
            "model": model,
            "status": self.status,
        }
        if self.tools:
            row["tools"] = self.tools
        if self.ended:
            row["ended"] = self.ended
        if +self.counts:
            row["tool_call_counts"] = dict(+self.counts)
        if self.error is not None:
            row["error"] = self.error
            row["failure"] = self.failure
        if self.refused:
            row["asked"] = 1  # the journal adds the earlier runs' asks
        if self.lost:
            row["lost"] = self.lost.as_dict()
        return row


def through_last_reply(messages: list[dict]) -> list[dict]:
    """`messages` cut after their last assistant turn (a row ends with what was generated)."""
    while messages and messages[-1]["role"] != "assistant":
        messages = messages[:-1]
    return messages


def regenerated_turns(rows: list[dict]) -> list[dict]:
    return [m for r in rows for m in r["messages"] if m["role"] == "assistant"]


def response_stats(rows: list[dict]) -> dict:
    turns = regenerated_turns(rows)
    finish = Counter(m["finish_reason"] for m in turns)
    usage = Counter()
    for message in turns:
        usage.update({k: v for k, v in message["usage"].items() if isinstance(v, int | float)})
    for row in rows:  # what the failed prompts' requests were billed
        if row.get("lost"):
            usage.update({"lost_tokens": row["lost"]["tokens"], "lost_cost": row["lost"]["cost"]})
    tool_calls = Counter(dict.fromkeys(TOOL_COUNTS, 0))
    for row in rows:
        tool_calls.update(row.get("tool_call_counts", {}))
    return {
        "prompts": len(rows),
        "status": dict(Counter(r["status"] for r in rows)),
        "failures": dict(Counter(r.get("failure") or "failed" for r in rows if r["status"] == "failed")),
        "ended": dict(Counter(r["ended"] for r in rows if r.get("ended"))),
        "finish_reasons": dict(finish),
        "assistant_turns": len(turns),
        "tool_calls": dict(tool_calls),
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
