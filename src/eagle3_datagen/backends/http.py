"""What the HTTP backends share: error classes, Retry-After, and the retry policy (tenacity).

An attempt either returns a parsed body or raises one of:
- `RetryableError`: 408, 429, 5xx, a 200 whose body carries an `error` object or no choice,
  a connection error or a timeout. Retried with capped exponential backoff and jitter, or
  after the server's `Retry-After` when it sends one.
- `RequestFailed`: this request is wrong and the next may not be (a 400 about the prompt, such as
  its length; a 403 that flags this input): recorded as this prompt's failure, not retried.
- `StopRun`: no request can succeed (401, a 402 without Retry-After, a 403 that flags no input, a
  404, a 400 that names a parameter the run sends with every request): no new requests start, in
  this job or any other of the run; finished work stays in the journal.
"""

from __future__ import annotations

import email.utils
import re
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


# A 400 whose message names one of these is about a setting every request carries (OpenRouter's
# "invalid or missing params"); one about the context length is about this prompt.
REQUEST_WIDE_400 = re.compile(
    r"\b(temperature|top_p|top_k|seed|max_tokens|max_new_tokens|reasoning|provider|model|tool_choice|"
    r"parameters?|sampling_params)\b",
    re.IGNORECASE,
)
PROMPT_400 = re.compile(r"context (length|window)|too (long|many tokens)|prompt is too", re.IGNORECASE)


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
    if status == 403 and not _flags_input(body):
        return StopRun(f"{reason}; the key may not use this model or route (a guardrail, a key limit, permissions)")
    if status == 404:
        return StopRun(f"{reason}; no endpoint serves this model with the run's routing and parameters")
    if status == 400 and REQUEST_WIDE_400.search(reason) and not PROMPT_400.search(reason):
        return StopRun(f"{reason}; a setting every request sends is refused: fix it in the config")
    return RequestFailed(reason)


def _flags_input(body: object) -> bool:
    """Whether a 403 is moderation flagging this request's input (its metadata names reasons or the input)."""
    error = body.get("error") if isinstance(body, dict) else None
    metadata = error.get("metadata") if isinstance(error, dict) else None
    return isinstance(metadata, dict) and bool(metadata.get("reasons") or metadata.get("flagged_input"))


@dataclass(frozen=True)
class RetryPolicy:
    """A backend's `retry` settings (`$defs.retry` in config.schema.yaml)."""

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
