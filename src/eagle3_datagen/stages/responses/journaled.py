"""Concurrent, resumable regeneration, every backend (SGLang, OpenRouter, in-process `hf`).

Each prompt is one conversation task (`conversation.Conversation`): its user turns are answered
in order, each on the regenerated history, tool calls checked against the recorded ones; the
finished row (success or failure with its reason) is appended to the journal at once. A
backend with `LockstepGroups` (`hf`) runs its fixed groups one at a time instead, and a group's
rows are journaled when the group is done, so a rerun batches what is left as an uninterrupted
run did. Budgets are checked before a conversation (or group) starts, so in-flight ones finish
and nothing is half-written. The final output is written only when every prompt is
in the journal, in prompt order; otherwise the job stops with what is done and what is left,
and a rerun continues from the journal.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3_datagen.backends.base import (
    AsyncGenerationBackend,
    ConversationGroup,
    LockstepGroups,
    RequestFailed,
    RetryableError,
    StopRun,
)
from eagle3_datagen.formats.files import read_jsonl, write_json, write_jsonl_zst
from eagle3_datagen.formats.journal import Journal, journal_path
from eagle3_datagen.progress import Progress
from eagle3_datagen.stages.responses.conversation import Conversation, response_stats, throughput

log = logging.getLogger(__name__)


class IncompleteRun(RuntimeError):
    """The run stopped before every prompt was answered; the journal keeps what was done."""


@dataclass
class Budgets:
    tokens: int | None = None  # prompt + completion tokens, over all runs of this job
    cost_usd: float | None = None

    def exceeded(self, usage: dict) -> str | None:
        if self.tokens is not None and usage.get("total_tokens", 0) >= self.tokens:
            return f"inference.token_budget={self.tokens} reached ({usage['total_tokens']} tokens used)"
        if self.cost_usd is not None and usage.get("cost", 0.0) >= self.cost_usd:
            return f"inference.openrouter.max_cost_usd={self.cost_usd} reached (${usage['cost']:.4f} spent)"
        return None


def row_usage(row: dict) -> dict:
    usage = {"total_tokens": 0, "cost": 0.0}
    for message in row["messages"]:
        if message["role"] == "assistant":
            u = message.get("usage") or {}
            usage["total_tokens"] += u.get("prompt_tokens", 0) + u.get("completion_tokens", 0)
            usage["cost"] += u.get("cost", 0.0) or 0.0
    return usage


async def _conversation(prompt: dict, backend: AsyncGenerationBackend, group: ConversationGroup | None) -> dict:
    conversation = Conversation(prompt)
    asker = group or backend
    while not conversation.done:
        try:
            turn = await asker.generate(conversation.messages, conversation.tools)
        except RequestFailed as e:
            conversation.fail(e.reason)
            break
        except RetryableError as e:
            conversation.fail(f"retries exhausted: {e.reason}")
            break
        conversation.add(turn)
    if group is not None:
        await group.leave()
    return conversation.row(backend.name, backend.model)


def _groups(prompts: list[dict], backend: AsyncGenerationBackend) -> list[list[dict]]:
    """The prompts that run together: each on its own, or a lockstep backend's groups, planned
    over every prompt (finished ones too) so that the plan does not depend on the journal."""
    if not isinstance(backend, LockstepGroups):
        return [[prompt] for prompt in prompts]
    first_turns = [(c.messages, c.tools) for c in map(Conversation, prompts)]
    return [[prompts[i] for i in group] for group in backend.groups(first_turns)]


async def _regenerate_group(prompts: list[dict], backend: AsyncGenerationBackend) -> list[dict]:
    group = backend.group(len(prompts)) if isinstance(backend, LockstepGroups) else None
    return list(await asyncio.gather(*(_conversation(prompt, backend, group) for prompt in prompts)))


async def regenerate_journaled(
    prompts: list[dict],
    backend: AsyncGenerationBackend,
    journal: Journal,
    budgets: Budgets,
    progress_interval: float = 30.0,
) -> str | None:
    """Answer every prompt not yet in `journal`; returns why the run stopped early, or None."""
    usage = {"total_tokens": 0, "cost": 0.0}
    for row in journal.rows.values():
        for key, value in row_usage(row).items():
            usage[key] += value
    pending = asyncio.Queue()
    for group in _groups(prompts, backend):
        if any(prompt["id"] not in journal.rows for prompt in group):
            pending.put_nowait(group)
    done = sum(prompt["id"] in journal.rows for prompt in prompts)
    progress = Progress(len(prompts), "prompts", log, done=done, interval=progress_interval)
    stopped: list[str] = []

    async def worker() -> None:
        while not stopped and not pending.empty():
            reason = budgets.exceeded(usage)
            if reason:
                stopped.append(reason)
                return
            group = pending.get_nowait()
            try:
                rows = await _regenerate_group(group, backend)
            except StopRun as e:
                stopped.append(str(e))
                return
            for row in rows:
                if row["id"] in journal.rows:  # journaled before a kill cut its group's journaling short
                    continue
                journal.append(row)
                spent = row_usage(row)
                for key, value in spent.items():
                    usage[key] += value
                progress.advance(tokens=spent["total_tokens"], failed=row["status"] == "failed", cost=spent["cost"])

    # A lockstep backend runs one group at a time: its batches are the groups'.
    workers = 1 if isinstance(backend, LockstepGroups) else max(1, min(backend.concurrency, pending.qsize()))
    try:
        async with backend:
            await asyncio.gather(*(worker() for _ in range(workers)))
    finally:
        progress.close()
        log.info("progress: %s", progress.line())
    return stopped[0] if stopped else None


def run_journaled_responses(
    prompts_path: str | Path,
    out_path: str | Path,
    stats_path: str | Path,
    backend: AsyncGenerationBackend,
    budgets: Budgets,
    progress_interval: float = 30.0,
    provenance: dict | None = None,
) -> dict:
    """`provenance`: how the job ran (settings that change float bits, not meaning), kept in the stats."""
    prompts = read_jsonl(prompts_path)
    fingerprint = json.dumps(backend.fingerprint(), sort_keys=True)
    journal = Journal(journal_path(out_path), fingerprint)
    resumed, started = set(journal.rows), time.monotonic()
    try:
        stopped = asyncio.run(regenerate_journaled(prompts, backend, journal, budgets, progress_interval))
    finally:
        journal.close()
    missing = [p["id"] for p in prompts if p["id"] not in journal.rows]
    if missing:
        raise IncompleteRun(
            f"{prompts_path}: {len(prompts) - len(missing)} of {len(prompts)} prompts finished, {len(missing)} left"
            f" ({stopped or 'stopped'}). They are kept in {journal.path}; rerun the same job to continue."
        )
    rows = [journal.rows[p["id"]] for p in prompts]
    write_jsonl_zst(out_path, rows)
    stats = {"backend": backend.name, "model": backend.model, **response_stats(rows)}
    stats["throughput"] = throughput([r for r in rows if r["id"] not in resumed], time.monotonic() - started)
    stats["failed"] = {r["id"]: r["error"] for r in rows if r["status"] == "failed"}
    if provenance:
        stats["provenance"] = provenance
    write_json(stats_path, stats)
    journal.remove()
    return stats
