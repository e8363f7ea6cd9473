"""What a responses job may start: its share of the endpoint's concurrency, what the run's budget
leaves, and whether the run was stopped.

With a ledger (`backends.ledger`, the workflow's jobs) these are the run's: the job looks at the
ledger every `TICK_S` seconds (its heartbeat: its conversations in flight and left, its shard's spend
and reservations) and takes its share. Under a budget each request of an API backend reserves its
worst case before it is sent (`reserve`: its prompt's bytes, an upper bound of its tokens, and the max
tokens, at `price_per_million`), checked against the run's spend and every live job's reservations
under the ledger's lock, and settles to what its answer cost once it is back (`settle`), so the run's
spend never passes the budget by more than the reservations' error. A request whose worst case does
not fit waits while anything is reserved (answers usually cost less than their worst case); with
nothing reserved anywhere, the budget is reached. Without a ledger (a shard answered outside the
workflow) they are the job's own.

The slots of the jobs on a node's launched SGLang server are that server's (`share`): a ledger in the
node's own directory, shared oldest job first by the shard jobs that use the server at once
(`inference.sglang.launch.shard_jobs`), so a shard near its end holds only what its long answers still
run and the next shard's conversations fill the rest of the server's batch.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from dataclasses import dataclass

from eagle3_datagen.backends.ledger import Ledger, Synced
from eagle3_datagen.formats.spend import Spend

log = logging.getLogger(__name__)

TICK_S = 0.5


@dataclass
class Budgets:
    tokens: int | None = None  # prompt + completion tokens, over every run
    cost_usd: float | None = None
    prices: dict | None = None  # USD per million prompt and completion tokens (price_per_million)

    def __post_init__(self) -> None:
        if self.cost_usd is not None and not self.prices:
            raise ValueError(
                "inference.openrouter.max_cost_usd needs inference.openrouter.price_per_million ({prompt: USD, "
                "completion: USD} per million tokens): each request reserves its worst case at that price"
            )

    def exceeded(self, spend: Spend, run_wide: bool) -> str | None:
        scope = "by the run" if run_wide else "by this shard"
        if self.tokens is not None and spend.tokens >= self.tokens:
            return f"inference.token_budget={self.tokens} reached ({spend.tokens} tokens used {scope})"
        if self.cost_usd is not None and spend.cost >= self.cost_usd:
            return f"inference.openrouter.max_cost_usd={self.cost_usd} reached (${spend.cost:.4f} spent {scope})"
        return None

    def fits(self, committed: Spend) -> bool:
        """Whether spend and reservations of `committed` stay within every budget."""
        return (self.tokens is None or committed.tokens <= self.tokens) and (
            self.cost_usd is None or committed.cost <= self.cost_usd
        )

    def worst_case(self, messages: list[dict], tools: list[dict] | None, max_tokens: int) -> Spend:
        """The most a request can cost: its prompt's tokens, at most the bytes of its messages and tools as
        JSON (a byte-level BPE token is at least a byte; the JSON's keys and quotes outweigh the chat
        template's few tokens per message), and `max_tokens` of answer (reasoning included), at the price."""
        prompt = len(json.dumps([messages, tools], ensure_ascii=False).encode())
        prices = self.prices or {}
        cost = prompt * prices.get("prompt", 0.0) / 1e6 + max_tokens * prices.get("completion", 0.0) / 1e6
        return Spend(cost, prompt + max_tokens)

    @property
    def any(self) -> bool:
        return self.tokens is not None or self.cost_usd is not None


class Limits:
    """Slots for conversations (`acquire`/`release`), the budget's reservations (`reserve`/`settle`) and the
    stop, for one job's event loop."""

    def __init__(
        self,
        budgets: Budgets,
        concurrency: int,
        spent_before: Spend,
        ledger: Ledger | None = None,
        share: Ledger | None = None,
    ):
        """`concurrency`: the job's own limit (the endpoint's, when a ledger shares it); `spent_before`:
        what the shard's journal already records (every turn it paid for); `share`: the ledger that shares
        the concurrency where it is not `ledger` (the node's server's, for its jobs at once)."""
        self.budgets = budgets
        self.ledger = ledger
        endpoint_shared = ledger is not None and ledger.concurrency is not None
        self.share = share if share is not None else (ledger if endpoint_shared else None)
        self.limit = concurrency if self.share is None else 0
        self.in_flight = 0
        self.left = 0  # conversations not started yet (the driver sets it)
        self.spent = spent_before  # this shard's whole spend
        self.reserved = Spend()  # the worst cases of this job's requests in flight
        self._requests = 0  # how many they are (none: `reserved` is set to exactly none, no float residue)
        self.stopped: str | None = None
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._seen = Synced(None, Spend(), None, 1)
        self._seen_own = spent_before
        # Every write to the ledger: each passes this job's spend and reservations as they are, so none may
        # overtake another (a look begun before a reservation would write it away).
        self._ledger_lock = asyncio.Lock()
        self._ticker: asyncio.Task | None = None
        self._first = True
        self._seen_jobs = 0

    async def __aenter__(self) -> Limits:
        if self.ledger is not None or self.share is not None:
            await self._sync()
            self._ticker = asyncio.create_task(self._tick())
        return self

    async def __aexit__(self, *exc) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
            if self.ledger is not None:
                await asyncio.to_thread(self.ledger.leave, self.spent)
            if self.share is not None and self.share is not self.ledger:
                await asyncio.to_thread(self.share.leave, Spend())

    # -- the ledger --------------------------------------------------------------------------------

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            await self._sync()

    async def _sync(self) -> None:
        async with self._ledger_lock:
            spent, now, seen, shared = self.spent, time.monotonic(), None, None
            if self.ledger is not None:
                seen = await asyncio.to_thread(
                    self.ledger.sync, self.in_flight, self.in_flight + self.left, spent, now, self._first, self.reserved
                )
                if self._first:
                    self.spent = spent = seen.own  # with what a killed job of the shard paid but never journaled
                self._seen, self._seen_own = seen, spent
            if self.share is not None:
                # the server's ledger holds no spend: the run's is `ledger`'s
                shared = seen if self.share is self.ledger else await asyncio.to_thread(
                    self.share.sync, self.in_flight, self.in_flight + self.left, Spend(), now
                )  # fmt: skip
            self._first = False
        if seen is not None and seen.stop and not self.stopped:
            self._stop(f"the run was stopped: {seen.stop}")
        if shared is not None:
            if (shared.limit, shared.jobs) != (self.limit, self._seen_jobs):
                log.info(
                    "share of the %s's concurrency: %d of %d, %d jobs (%d conversations in flight, %d left)",
                    "endpoint" if self.share is self.ledger else "node's server",
                    shared.limit,
                    self.share.concurrency,
                    shared.jobs,
                    self.in_flight,
                    self.left,
                )
            self.limit, self._seen_jobs = shared.limit, shared.jobs
            self._wake()

    def total(self) -> Spend:
        """The run's spend as last seen, with this job's own since (without a ledger: this shard's)."""
        if self.ledger is None:
            return self.spent
        return self._seen.total + (self.spent - self._seen_own)

    # -- the budget's reservations -----------------------------------------------------------------

    async def reserve(self, worst: Spend) -> str | None:
        """Before a request: hold its `worst` case against the budget; None once held, else why not (the
        budget is reached, or the run stopped). Waits while others' reservations may return room."""
        if not self.budgets.any or worst == Spend():
            return None
        while not self.stopped:
            async with self._ledger_lock:
                if self.ledger is None:
                    held, total, reserved = (
                        self.budgets.fits(self.spent + self.reserved + worst),
                        self.spent,
                        self.reserved,
                    )
                else:
                    found = await asyncio.to_thread(
                        self.ledger.reserve, worst, self.reserved, self.spent, self.budgets.fits, time.monotonic()
                    )
                    held, total, reserved = found.held, found.total, found.reserved
                if held:
                    self.reserved, self._requests = self.reserved + worst, self._requests + 1
                    return None
            if reserved.tokens == 0:  # nothing in flight anywhere (a reservation always holds tokens)
                scope = "the run's" if self.ledger is not None else "this shard's"
                reason = self.budgets.exceeded(total, self.ledger is not None) or (
                    f"the budget is reached: {scope} ${total.cost:.4f} and {total.tokens} tokens spent leave too "
                    f"little for a request's worst case (${worst.cost:.4f}, {worst.tokens} tokens; "
                    "inference.openrouter.max_cost_usd, inference.token_budget)"
                )
                self._stop(reason)
                return reason
            await asyncio.sleep(TICK_S)
        return self.stopped

    async def settle(self, worst: Spend, cost: Spend) -> None:
        """A request came back (an answer, a failure, a cut): its reservation, `worst`, is replaced by
        what it `cost`, in the ledger in one step."""
        async with self._ledger_lock:
            if worst != Spend():
                self._requests -= 1
                self.reserved = self.reserved - worst if self._requests else Spend()
            self.spent = self.spent + cost
            if self.ledger is not None and worst != Spend():
                await asyncio.to_thread(self.ledger.settle, self.reserved, self.spent)

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
        while not self.stopped and self.left > 0 and self.in_flight >= self.limit:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter
        if self.stopped:
            return self.stopped
        if self.left <= 0:
            return "every conversation has started"
        if self.budgets.any and (reason := self.budgets.exceeded(self.total(), self.ledger is not None)):
            self._stop(reason)
            return reason
        self.in_flight += 1
        self.left -= 1
        if self.left == 0:
            self._wake()  # the workers still waiting for a slot have nothing to start
        return None

    def release(self) -> None:
        """A conversation ended (its turns' cost was settled as each came back)."""
        self.in_flight -= 1
        self._wake()

    async def stop_run(self, reason: str, run_wide: bool = True) -> None:
        """No request can succeed: stop this job and (`run_wide`) every job of the run on the endpoint."""
        self._stop(reason)
        if run_wide and self.ledger is not None:
            await asyncio.to_thread(self.ledger.stop_run, reason)
