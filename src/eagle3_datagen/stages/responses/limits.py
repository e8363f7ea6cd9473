"""What a responses job may start: its share of the endpoint's concurrency, what the run's budget
leaves, and whether the run was stopped.

With a ledger (`backends.ledger`, the workflow's jobs) these are the run's: the job looks at the
ledger every `TICK_S` seconds (its heartbeat: its conversations in flight and left, its shard's spend)
and takes its share. The budget is checked before each conversation against the run's spend as last
seen plus this job's own since; near the end of a budget that view is refreshed before every
conversation and after every answer (whose slot is free again only once the ledger holds its spend),
so no conversation starts once the run's answers have reached the budget: at most the conversations
in flight then (the endpoint's concurrency) finish past it. Without a ledger (a shard answered outside
the workflow) they are the job's own.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass

from eagle3_datagen.backends.ledger import Ledger, Spend, Synced

log = logging.getLogger(__name__)

TICK_S = 0.5
# Far from the budget a job trusts its last look at the ledger. The others' spend it has not seen yet
# is taken as the larger of: the run's recent rate over this many ticks (seen late by a tick, written
# late by one) times a margin, and an answer for every conversation the run may have in flight (a
# burst of them coming back at once), at what this job's answers cost on average. Within that of the
# budget, every start and answer looks again.
UNSEEN_TICKS = 2
RATE_MARGIN = 4.0


@dataclass
class Budgets:
    tokens: int | None = None  # prompt + completion tokens, over every run
    cost_usd: float | None = None

    def exceeded(self, spend: Spend, run_wide: bool) -> str | None:
        scope = "by the run" if run_wide else "by this shard"
        if self.tokens is not None and spend.tokens >= self.tokens:
            return f"inference.token_budget={self.tokens} reached ({spend.tokens} tokens used {scope})"
        if self.cost_usd is not None and spend.cost >= self.cost_usd:
            return f"inference.openrouter.max_cost_usd={self.cost_usd} reached (${spend.cost:.4f} spent {scope})"
        return None

    def near(self, spend: Spend, margin: Spend) -> bool:
        """Whether `spend` is within `margin` of a budget."""
        return (self.tokens is not None and spend.tokens + margin.tokens >= self.tokens) or (
            self.cost_usd is not None and spend.cost + margin.cost >= self.cost_usd
        )

    @property
    def any(self) -> bool:
        return self.tokens is not None or self.cost_usd is not None


class Limits:
    """Slots for conversations (`acquire`/`release`), the budget and the stop, for one job's event loop."""

    def __init__(self, budgets: Budgets, concurrency: int, spent_before: Spend, ledger: Ledger | None = None):
        """`concurrency`: the job's own limit (the endpoint's, when the ledger shares it); `spent_before`:
        the spend of the rows the shard's journal already holds."""
        self.budgets = budgets
        self.ledger = ledger
        self.limit = concurrency if ledger is None or ledger.concurrency is None else 0
        self.in_flight = 0
        self.left = 0  # conversations not started yet (the driver sets it)
        self.spent = spent_before  # this shard's whole spend
        self._spent_before, self._answers = spent_before, 0  # this run's answers: their spend, their count
        self.stopped: str | None = None
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._seen = Synced(None, Spend(), None, 1)
        self._seen_own = spent_before
        self._rates: collections.deque[tuple[float, Spend]] = collections.deque(maxlen=8)
        self._sync_lock = asyncio.Lock()
        self._syncs_started = 0
        self._ticker: asyncio.Task | None = None
        self._first = True
        self._seen_jobs = 0

    async def __aenter__(self) -> Limits:
        if self.ledger is not None:
            await self._sync()
            self._ticker = asyncio.create_task(self._tick())
        return self

    async def __aexit__(self, *exc) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
            await asyncio.to_thread(self.ledger.leave, self.spent)

    # -- the ledger --------------------------------------------------------------------------------

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            await self._sync()

    async def _sync(self) -> None:
        async with self._sync_lock:
            await self._sync_locked()

    async def _sync_locked(self) -> None:
        self._syncs_started += 1
        spent, now = self.spent, time.monotonic()
        seen = await asyncio.to_thread(
            self.ledger.sync, self.in_flight, self.in_flight + self.left, spent, now, self._first
        )
        self._first = False
        self._seen, self._seen_own = seen, spent
        self._rates.append((now, seen.total))
        if seen.stop and not self.stopped:
            self._stop(f"the run was stopped: {seen.stop}")
        if seen.limit is not None:
            if (seen.limit, seen.jobs) != (self.limit, self._seen_jobs):
                log.info(
                    "share of the endpoint's concurrency: %d of %d, %d jobs (%d conversations in flight, %d left)",
                    seen.limit,
                    self.ledger.concurrency,
                    seen.jobs,
                    self.in_flight,
                    self.left,
                )
            self.limit, self._seen_jobs = seen.limit, seen.jobs
            self._wake()

    async def _fresh(self) -> None:
        """Return after a look at the ledger that began after this call: every look runs under the lock, so
        once a caller holds it, each look begun before is done; callers waiting together share one."""
        wanted = self._syncs_started + 1
        async with self._sync_lock:
            if self._syncs_started < wanted:
                await self._sync_locked()

    def _strict(self) -> bool:
        """Near the end of a budget (or before the run's rate is known): look at the ledger at every start
        and answer."""
        if self.ledger is None or not self.budgets.any:
            return False
        margin = self._margin()
        return margin is None or self.budgets.near(self.total(), margin)

    def _margin(self) -> Spend | None:
        """The others' spend this job may not have seen yet (None: not known before the run's rate and this
        job's first answer)."""
        if len(self._rates) < 2 or not self._answers:
            return None
        (t0, first), (t1, last) = self._rates[0], self._rates[-1]
        window = UNSEEN_TICKS * TICK_S * RATE_MARGIN / max(t1 - t0, 1e-3)
        grown = last - first
        own = self.spent - self._spent_before
        burst = (self.ledger.concurrency or self.limit * self._seen.jobs) / self._answers  # in flight, at most
        return Spend(
            max(grown.cost * window, own.cost * burst, 0.0), int(max(grown.tokens * window, own.tokens * burst, 0))
        )

    def total(self) -> Spend:
        """The spend the budget is held to: the run's as last seen, with this job's own since."""
        if self.ledger is None:
            return self.spent
        return self._seen.total + (self.spent - self._seen_own)

    # -- the slots ---------------------------------------------------------------------------------

    def _wake(self) -> None:
        while self._waiters and (self.in_flight < self.limit or self.stopped or self.left <= 0):
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    def _stop(self, reason: str) -> None:
        self.stopped = reason
        self._wake()

    async def acquire(self) -> str | None:
        """Wait for a slot to start a conversation in; None once it has one, else why none will come."""
        while True:
            while not self.stopped and self.left > 0 and self.in_flight >= self.limit:
                waiter = asyncio.get_running_loop().create_future()
                self._waiters.append(waiter)
                await waiter
            if self.stopped:
                return self.stopped
            if self.left <= 0:
                return "every conversation has started"
            if self.budgets.any:
                run_wide = self.ledger is not None
                reason = self.budgets.exceeded(self.total(), run_wide)
                if reason is None and self._strict():
                    await self._fresh()  # others may take slots meanwhile: all is looked at again below
                    reason = self.stopped or self.budgets.exceeded(self.total(), run_wide)
                if reason is not None:
                    self._stop(reason)
                    return reason
                if self.left <= 0 or self.in_flight >= self.limit:
                    continue
            self.in_flight += 1
            self.left -= 1
            if self.left == 0:
                self._wake()  # the workers still waiting for a slot have nothing to start
            return None

    async def release(self, spent: Spend) -> None:
        """A conversation ended, having cost `spent`."""
        self.spent = self.spent + spent
        self._answers += 1
        if self._strict():
            # Near the end of the budget its slot is given again only once the ledger holds its spend: a
            # conversation counts against the budget or holds a slot, so at most `concurrency` run past it.
            await self._fresh()
        self.in_flight -= 1
        self._wake()

    async def stop_run(self, reason: str, run_wide: bool = True) -> None:
        """No request can succeed: stop this job and (`run_wide`) every job of the run on the endpoint."""
        self._stop(reason)
        if run_wide and self.ledger is not None:
            await asyncio.to_thread(self.ledger.stop_run, reason)
