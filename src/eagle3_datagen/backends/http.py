"""What the HTTP backends share: error classes, Retry-After, and the retry policy (tenacity).

An attempt either returns a parsed body or raises one of:
- `RetryableError`: 408, 429, 5xx, a 200 whose body carries an `error` object or no choice,
  a connection error or a timeout. Retried with capped exponential backoff and jitter, or
  after the server's `Retry-After` when it sends one.
- `RequestFailed`: the request itself is wrong (400, 403, a 402 that will not clear): recorded
  as this prompt's failure, not retried.
- `StopRun`: nothing more can succeed (401, a 402 without Retry-After): no new requests start;
  finished work stays in the journal.
"""

from __future__ import annotations

import email.utils
import time
from dataclasses import dataclass

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from eagle3_datagen.backends.base import RequestFailed, RetryableError, StopRun


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header: delta-seconds or an HTTP date."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        parsed = email.utils.parsedate_to_datetime(value)
        return max(0.0, parsed.timestamp() - time.time()) if parsed else None


def error_message(body: object) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        error = body["error"]
        return f"{error.get('code', '')} {error.get('message', '')}".strip()
    return str(body)[:300]


def classify(status: int, body: object, retry_after: float | None) -> Exception:
    """The exception for a non-200 answer, by OpenRouter's and SGLang's documented statuses."""
    reason = f"HTTP {status}: {error_message(body)}"
    if status == 401:
        return StopRun(f"{reason}; the API key is missing or invalid")
    if status == 402:
        if retry_after is not None:
            return RetryableError(reason, retry_after)
        return StopRun(f"{reason}; the account is out of credits: add credits, then rerun to continue")
    if status in (408, 429) or status >= 500:
        return RetryableError(reason, retry_after)
    return RequestFailed(reason)


@dataclass(frozen=True)
class RetryPolicy:
    """A backend's `retry` settings (`$defs.retry` in schemas/config.schema.yaml)."""

    max_attempts: int
    initial_backoff: float
    max_backoff: float
    max_retry_after: float

    @classmethod
    def from_config(cls, section: dict) -> RetryPolicy:
        """From the validated config's `retry` section, where validation filled every default."""
        return cls(**{name: section[name] for name in cls.__dataclass_fields__})

    def _wait(self, state: RetryCallState) -> float:
        error = state.outcome.exception() if state.outcome else None
        if isinstance(error, RetryableError) and error.retry_after is not None:
            return min(error.retry_after, self.max_retry_after)
        return wait_exponential_jitter(
            multiplier=self.initial_backoff, max=self.max_backoff, jitter=self.initial_backoff
        )(state)

    def retrying(self) -> AsyncRetrying:
        return AsyncRetrying(
            retry=retry_if_exception_type(RetryableError),
            stop=stop_after_attempt(self.max_attempts),
            wait=self._wait,
            reraise=True,
        )
