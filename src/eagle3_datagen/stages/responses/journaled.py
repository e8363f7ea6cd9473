"""Concurrent, resumable regeneration, every backend (SGLang, OpenRouter, in-process `hf`).

Each prompt is one conversation task (`conversation.Conversation`): its user turns are answered
in order, each on the regenerated history, tool calls checked against the recorded ones; the
finished row (success or failure with its reason) is appended to the journal at once. A
backend with `LockstepGroups` (`hf`) runs its fixed groups one at a time instead, and a group's
rows are journaled when the group is done, so a rerun batches what is left as an uninterrupted
run did. A conversation (or group) starts only with a slot of the job's share of the endpoint's
concurrency (a launched server's: its node's) and while the budget lasts (`limits.Limits`: the run's,
with the workflow's ledger), so
in-flight ones finish and nothing is half-written. The final output is written only when every
prompt is in the journal, in prompt order, and no more of them failed than `max_failed_rate`
allows; otherwise the job stops with what is done, what failed and why, and a rerun continues from
the journal, asking again only for the prompts not answered; a prompt the provider refused (too long,
flagged: `RequestFailed`, never retried) at most `ASKS_PER_REFUSAL` times in all. The journal stays as the shard's
answers: a rerun under a raised token limit keeps every answer that ended within the old one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import gc
import json
import logging
import time
from pathlib import Path

from eagle3_datagen.backends.base import (
    AsyncGenerationBackend,
    ConversationGroup,
    LockstepGroups,
    RequestFailed,
    RetryableError,
    ServerGone,
    StopRun,
)
from eagle3_datagen.backends.ledger import Ledger
from eagle3_datagen.formats.files import read_jsonl, write_json, write_jsonl_zst
from eagle3_datagen.formats.journal import ASKS_PER_REFUSAL, Journal, journal_path, row_spend
from eagle3_datagen.formats.spend import Spend
from eagle3_datagen.progress import Progress
from eagle3_datagen.stages.responses.conversation import Conversation, response_stats, throughput
from eagle3_datagen.stages.responses.limits import Budgets, Limits

log = logging.getLogger(__name__)

# A conversation the budget stopped between two turns: its row's error starts so.
BUDGET_CUT = "budget: "
# How many of the commonest failure reasons a failed job names.
REASONS_SHOWN = 3
# Container allocations between two young-generation collections while requests are in flight (Python's
# default is 700): at 2,000 in flight each collection walks thousands of young request objects, and the
# collector took a quarter of the client's CPU (BENCHMARKS.md, the API client row).
YOUNG_COLLECTION_EVERY = 20_000


class IncompleteRun(RuntimeError):
    """The run stopped before every prompt was answered; the journal keeps what was done."""


class TooManyFailed(IncompleteRun):
    """More prompts failed than `max_failed_rate` allows; the journal keeps the answered ones."""


async def _conversation(
    prompt: dict, backend: AsyncGenerationBackend, group: ConversationGroup | None, limits: Limits
) -> dict | None:
    """The prompt's row, or None when the budget left no room for its first turn (nothing was paid: the
    prompt is asked again by a rerun). Each request of an API backend (one with `max_tokens`; a lockstep
    group's turns wait for each other and reserve nothing) reserves its worst case before it is sent and
    settles to what it cost when it is back, answered or not."""
    conversation = Conversation(prompt)
    asker = group or backend
    max_tokens = getattr(backend, "max_tokens", None) if group is None and limits.budgets.any else None
    answered = 0
    while not conversation.done:
        worst = (
            limits.budgets.worst_case(conversation.messages, conversation.tools, max_tokens) if max_tokens else Spend()
        )
        if (reason := await limits.reserve(worst)) is not None:
            if not answered:
                return None
            # its paid turns stay counted; a rerun asks again
            conversation.fail(f"{BUDGET_CUT}{reason}", "budget", Spend())
            break
        cost = Spend()
        try:
            turn = await asker.generate(conversation.messages, conversation.tools)
            cost = Spend.of_usage(turn.usage)
        except RequestFailed as e:
            cost = e.lost
            conversation.fail(e.reason, e.kind, e.lost, refused=True)
        except RetryableError as e:
            cost = e.lost
            conversation.fail(f"retries exhausted: {e.reason}", "retries_exhausted", e.lost)
        else:
            conversation.add(turn)
            answered += 1
        finally:
            await limits.settle(worst, cost)
    if group is not None:
        await group.leave()
    return conversation.row(backend.name, backend.model)


async def regenerate_journaled(
    prompts: list[dict],
    backend: AsyncGenerationBackend,
    journal: Journal,
    limits: Limits,
    progress_interval: float = 30.0,
) -> str | None:
    """Answer every prompt not yet in `journal`; returns why the run stopped early, or None."""
    lockstep = isinstance(backend, LockstepGroups)
    if lockstep:
        # Planned over every prompt (finished ones too), so that the plan does not depend on the journal.
        first_turns = [(c.messages, c.tools) for c in map(Conversation, prompts)]
        planned = [[prompts[i] for i in group] for group in backend.groups(first_turns)]
    else:
        planned = [[prompt] for prompt in prompts]
    pending = collections.deque(g for g in planned if any(prompt["id"] not in journal.rows for prompt in g))
    limits.left = len(pending)
    done = sum(prompt["id"] in journal.rows for prompt in prompts)
    progress = Progress(len(prompts), "prompts", log, done=done, interval=progress_interval)

    async def answer(group: list[dict]) -> list[dict | None]:
        if not lockstep:
            return [await _conversation(group[0], backend, None, limits)]
        together = backend.group(len(group))
        return list(await asyncio.gather(*(_conversation(prompt, backend, together, limits) for prompt in group)))

    async def worker() -> None:
        while pending:
            if await limits.acquire() is not None:
                return
            group = pending.popleft()  # a slot is given for each group left, no more
            try:
                rows = await answer(group)
            except StopRun as e:
                await limits.stop_run(str(e), run_wide=not isinstance(e, ServerGone))
                limits.release()
                return
            for row in rows:
                # None: the budget left no room to ask; journaled: before a kill cut its group's journaling short
                if row is None or row["id"] in journal.rows:
                    continue
                if "asked" in row:
                    row["asked"] += journal.refused_asks.get(row["id"], 0)
                journal.append(row)
                row_cost = row_spend(row)
                progress.advance(tokens=row_cost.tokens, failed=row["status"] == "failed", cost=row_cost.cost)
            limits.release()

    # A lockstep backend runs one group at a time: its batches are the groups'.
    workers = 1 if lockstep else max(1, min(backend.concurrency, len(pending)))
    try:
        async with backend, limits:
            await asyncio.gather(*(worker() for _ in range(workers)))
    finally:
        progress.close()
        log.info("progress: %s", progress.line())
    return limits.stopped


@contextlib.contextmanager
def _collecting_young_every(allocations: int):
    threshold = gc.get_threshold()
    gc.set_threshold(allocations, *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)


def answers_still_valid(backend: AsyncGenerationBackend, current: dict, old: str):
    """For a journal written under `old` settings: which of its rows `backend`'s would produce too, or None.

    Only the length limits may differ (`backend.limit_keys`): a row is kept when every one of its turns
    ended (not cut at the limit) within the limit that now applies to it; greedy decoding would give
    the same tokens, sampling a valid sample. A truncated answer is asked for again."""
    if _without(json.loads(old), backend.limit_keys) != _without(current, backend.limit_keys):
        return None

    def ended_within(row: dict) -> bool:
        return all(
            m["finish_reason"] in ("stop", "tool_calls")
            and (m.get("usage") or {}).get("completion_tokens", 0) < backend.limit_for(m)
            for m in row["messages"]
            if m["role"] == "assistant"
        )

    return ended_within


def _without(fingerprint: dict, keys: tuple[str, ...]) -> dict:
    """`fingerprint` less the dotted `keys` (a number indexes a list)."""
    stripped = copy.deepcopy(fingerprint)
    for key in keys:
        *parents, last = key.split(".")
        node = stripped
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else (node or {}).get(part)
        if isinstance(node, dict):
            node.pop(last, None)
    return stripped


def _cut_by_budget(row: dict) -> bool:
    return row["status"] == "failed" and row.get("error", "").startswith(BUDGET_CUT)


def failure_summary(shard, failed: list[dict], total: int) -> str:
    """How many prompts failed, per reason (the commonest first, each with one of its messages), in one line."""
    by_reason = collections.defaultdict(list)
    for row in failed:
        by_reason[row.get("failure") or "failed"].append(row["error"])
    reasons = sorted(by_reason.items(), key=lambda item: -len(item[1]))[:REASONS_SHOWN]
    said = "; ".join(f"{len(errors)} {reason} (e.g. {errors[0][:160]!r})" for reason, errors in reasons)
    return f"{shard}: {len(failed)} of {total} prompts failed ({len(failed) / total:.1%}): {said}"


def run_journaled_responses(
    prompts_path: str | Path,
    out_path: str | Path,
    stats_path: str | Path,
    backend: AsyncGenerationBackend,
    budgets: Budgets,
    progress_interval: float = 30.0,
    provenance: dict | None = None,
    ledger: Ledger | None = None,
    max_failed_rate: float | None = None,
    share: Ledger | None = None,
) -> dict:
    """`provenance`: how the job ran (settings that change float bits, not meaning), kept in the stats;
    `ledger`: the endpoint's run-wide limits (None: the job's own); `max_failed_rate`: the share of the
    shard's prompts that may fail (None: any); `share`: the node's server's concurrency, shared with the
    other jobs that use it at once (None: the ledger's, else the job's own)."""
    prompts = read_jsonl(prompts_path)
    fingerprint = backend.fingerprint()
    journal = Journal(
        journal_path(out_path),
        json.dumps(fingerprint, sort_keys=True),
        lambda old: answers_still_valid(backend, fingerprint, old),
    )
    resumed, started = set(journal.rows), time.monotonic()
    limits = Limits(budgets, backend.concurrency, journal.spent, ledger, share)
    try:
        with _collecting_young_every(YOUNG_COLLECTION_EVERY):
            stopped = asyncio.run(regenerate_journaled(prompts, backend, journal, limits, progress_interval))
    finally:
        journal.close()
    # a conversation the budget cut between two turns is journaled (its turns were paid) but not done
    missing = [p["id"] for p in prompts if p["id"] not in journal.rows or _cut_by_budget(journal.rows[p["id"]])]
    if missing:
        raise IncompleteRun(
            f"{prompts_path}: {len(prompts) - len(missing)} of {len(prompts)} prompts finished, {len(missing)} left"
            f" ({stopped or 'stopped'}). They are kept in {journal.path}; rerun the same job to continue."
        )
    rows = [journal.rows[p["id"]] for p in prompts]
    failed = [r for r in rows if r["status"] == "failed"]
    if max_failed_rate is not None and len(failed) > max_failed_rate * len(prompts):
        raise TooManyFailed(
            f"{failure_summary(out_path, failed, len(prompts))}; above inference.max_failed_rate="
            f"{max_failed_rate}. "
            f"The {len(prompts) - len(failed)} answered are kept in {journal.path}: rerun to ask again for the "
            f"failed ones only (a prompt the provider refused {ASKS_PER_REFUSAL} times is not asked again)"
        )
    write_jsonl_zst(out_path, rows)
    stats = {"backend": backend.name, "model": backend.model, **response_stats(rows)}
    stats["throughput"] = throughput([r for r in rows if r["id"] not in resumed], time.monotonic() - started)
    stats["failed"] = {r["id"]: r["error"] for r in rows if r["status"] == "failed"}
    stats["spent"] = journal.spent.as_dict()  # every turn paid for: failed and replaced rows' too
    if provenance:
        stats["provenance"] = provenance
    write_json(stats_path, stats)
    return stats
