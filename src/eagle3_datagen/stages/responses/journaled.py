"""Concurrent, resumable regeneration over HTTP backends (SGLang, OpenRouter).

Each prompt is one conversation task (`conversation.Conversation`): its user turns are answered
in order, each on the regenerated history, tool calls checked against the recorded ones; the
finished row (success or failure with its reason) is appended to the journal at once.
Budgets are checked before a conversation starts, so in-flight ones finish and nothing is
half-written. The final output is written only when every prompt is
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

from eagle3_datagen.backends.base import AsyncGenerationBackend, RequestFailed, RetryableError, StopRun
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


async def _conversation(prompt: dict, backend: AsyncGenerationBackend) -> dict:
    conversation = Conversation(prompt)
    while not conversation.done:
        try:
            turn = await backend.generate(conversation.messages, conversation.tools)
        except RequestFailed as e:
            conversation.fail(e.reason)
            break
        except RetryableError as e:
            conversation.fail(f"retries exhausted: {e.reason}")
            break
        conversation.add(turn)
    return conversation.row(backend.name, backend.model)


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
    for prompt in prompts:
        if prompt["id"] not in journal.rows:
            pending.put_nowait(prompt)
    progress = Progress(len(prompts), "prompts", log, done=len(prompts) - pending.qsize(), interval=progress_interval)
    stopped: list[str] = []

    async def worker() -> None:
        while not stopped and not pending.empty():
            reason = budgets.exceeded(usage)
            if reason:
                stopped.append(reason)
                return
            prompt = pending.get_nowait()
            try:
                row = await _conversation(prompt, backend)
            except StopRun as e:
                stopped.append(str(e))
                return
            journal.append(row)
            spent = row_usage(row)
            for key, value in spent.items():
                usage[key] += value
            progress.advance(tokens=spent["total_tokens"], failed=row["status"] == "failed", cost=spent["cost"])

    try:
        async with backend:
            await asyncio.gather(*(worker() for _ in range(max(1, min(backend.concurrency, pending.qsize())))))
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
