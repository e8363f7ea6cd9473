"""Progress of a long job: a live bar on a terminal, plain lines in a log file.

Jobs run by Snakemake write to `logs/`: there a bar's carriage returns would turn into noise, so
the same numbers go out as one log line every `interval` seconds (and at the end) instead.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import Counter

from tqdm import tqdm


class Progress:
    def __init__(self, total: int, unit: str, logger: logging.Logger, done: int = 0, interval: float = 30.0):
        self.total = total
        self.unit = unit
        self.done = done
        self.counters: Counter = Counter()
        self.logger = logger
        self.interval = interval
        self._first = done
        self._started = time.monotonic()
        self._last_line = self._started
        self._bar = tqdm(total=total, initial=done, unit=unit, dynamic_ncols=True) if sys.stderr.isatty() else None

    def advance(self, n: int = 1, **counters: float) -> None:
        """`n` more units done; `counters` (tokens, failed, cost, ...) add up and show as rates or totals."""
        self.done += n
        for name, value in counters.items():  # not Counter.update: this runs for each of 2,000 answers a second
            self.counters[name] += value
        if self._bar is not None:
            self._bar.set_postfix_str(self._details(), refresh=False)  # drawn by update, at tqdm's own rate
            self._bar.update(n)
        elif time.monotonic() - self._last_line >= self.interval or self.done >= self.total:
            self._last_line = time.monotonic()
            self.logger.info("progress: %s", self.line())

    def _details(self) -> str:
        elapsed = max(time.monotonic() - self._started, 1e-9)
        parts = []
        if "tokens" in self.counters:
            parts.append(f"{self.counters['tokens'] / elapsed:.0f} tokens/s")
        if "failed" in self.counters:
            parts.append(f"{self.counters['failed']:.0f} failed")
        if "cost" in self.counters:
            parts.append(f"${self.counters['cost']:.4f}")
        return ", ".join(parts)

    def line(self) -> str:
        elapsed = max(time.monotonic() - self._started, 1e-9)
        rate = (self.done - self._first) / elapsed
        eta = f"{(self.total - self.done) / rate:.0f} s" if rate > 0 else "unknown"
        details = self._details()
        return (
            f"{self.done}/{self.total} {self.unit}, {rate:.1f} {self.unit}/s"
            + (f", {details}" if details else "")
            + f", ETA {eta}"
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
