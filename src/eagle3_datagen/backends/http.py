"""What the HTTP backends share: error classes, Retry-After, and the retry policy (tenacity).

An attempt either returns a parsed body or raises one of, read from the bodies OpenRouter and the
providers behind it send (tests/fixtures/provider_errors.yaml holds them, with where each was read):
- `RequestFailed`: the provider refuses this prompt and would refuse it again, with a short stable
  `kind`: `context_overflow` (any provider's wording: OpenRouter's, Moonshot's "exceeded model token
  limit", OpenAI's, Anthropic's, vLLM's and SGLang's, whatever the status it comes in), `moderation` (a
  403 flagging the input), `guardrail` (a 403 naming the patterns it blocked), `too_large` (413),
  `provider_refused` (a 400 OpenRouter wraps as "Provider returned error", the provider's body in
  `metadata.raw`) or `bad_request` (another 400 about the request). Recorded as that prompt's failure,
  never retried.
- `RetryableError`: 408, 429, 5xx, a 200 whose body or stream carries an error or no choice, a cut
  stream, a connection error or a timeout. Retried with capped exponential backoff and jitter, or after
  the server's `Retry-After` when it sends one.
- `StopRun`: what every request sends is refused (401: the key; 402 without Retry-After: the credits;
  a 403 that flags no input: the key's permissions or routing; 404: the model or its routing; a 400 not
  wrapped per provider that names a setting, or a wrapped one whose `param` is one): no new requests
  start, in this job or any other of the run; finished work stays in the journal. The message is the
  provider's own.
"""

from __future__ import annotations

import email.utils
import json
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


# The parameters every request of a run carries alike: a provider naming one refuses them all.
REQUEST_WIDE = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "max_tokens",
    "max_new_tokens",
    "reasoning",
    "provider",
    "model",
    "tool_choice",
    "sampling_params",
)
REQUEST_WIDE_400 = re.compile(rf"\b({'|'.join(REQUEST_WIDE)}|parameters?)\b", re.IGNORECASE)
# A prompt longer than the model takes, in each provider's and server's words.
CONTEXT_OVERFLOW = re.compile(
    r"context[_ ](length|window)|maximum context|exceeded model token limit|prompt is too long|"
    r"longer than the (model's )?(context length|maximum model length)|too many tokens|"
    r"reduce the length of the (messages|prompt)",
    re.IGNORECASE,
)
WRAPPED = "Provider returned error"  # OpenRouter's message where the provider's body is in metadata.raw


@dataclass(frozen=True)
class ErrorBody:
    """What an error answer says. `message`: OpenRouter's (or the server's) message; `raw`: the provider's
    own message where OpenRouter wraps its body (`metadata.raw`), else ""; `param`: the request parameter
    the error names, where it names one (OpenAI's `param`)."""

    message: str
    raw: str
    provider: str | None
    param: str | None
    metadata: dict

    @property
    def wrapped(self) -> bool:
        return bool(self.raw) or self.message == WRAPPED

    @property
    def text(self) -> str:
        """Both messages, the provider's first: what a person reads and the patterns are matched on."""
        return " | ".join(m for m in (self.raw, "" if self.message == WRAPPED else self.message) if m)

    def said(self, status: int) -> str:
        by = f" from {self.provider}" if self.provider else ""
        return f"HTTP {status}{by}: {self.text[:500] or self.message}"


def read_error(body: object) -> ErrorBody:
    """The error in `body`: OpenRouter's `{"error": {"code", "message", "metadata"}}`, OpenAI's and
    Anthropic's `error` objects, or vLLM's and SGLang's top-level `{"object": "error", "message"}`."""
    if not isinstance(body, dict):
        return ErrorBody(str(body)[:500], "", None, None, {})
    error = body["error"] if isinstance(body.get("error"), dict) else body
    metadata = error.get("metadata") if isinstance(error.get("metadata"), dict) else {}
    raw_message, raw_param = _raw(metadata.get("raw"))
    return ErrorBody(
        message=str(error.get("message") or error.get("detail") or ""),
        raw=raw_message,
        provider=metadata.get("provider_name"),
        param=error.get("param") or raw_param,
        metadata=metadata,
    )


def _raw(raw: object) -> tuple[str, str | None]:
    """The provider's message and named parameter from OpenRouter's `metadata.raw` (a JSON text, an object
    or plain text)."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return raw.strip(), None
    if not isinstance(raw, dict):
        return ("" if raw is None else str(raw)), None
    inner = raw["error"] if isinstance(raw.get("error"), dict) else raw
    message = inner.get("message") or inner.get("detail") or inner.get("error_message") or ""
    return str(message), inner.get("param")


def classify(status: int, body: object, retry_after: float | None) -> Exception:
    """The exception for an error answer (`status`: its HTTP status, or the code a stream's error names)."""
    error = read_error(body)
    said = error.said(status)
    if status not in (401, 402, 429) and CONTEXT_OVERFLOW.search(error.text):
        return RequestFailed(said, "context_overflow")
    if status == 401:
        return StopRun(f"{said}; the API key is missing or invalid")
    if status == 402:
        if retry_after is not None:
            return RetryableError(said, retry_after)
        return StopRun(f"{said}; the account is out of credits: add credits, then rerun to continue")
    if status == 403:
        if error.metadata.get("reasons") or error.metadata.get("flagged_input"):
            return RequestFailed(said, "moderation")
        if error.metadata.get("patterns"):
            return RequestFailed(said, "guardrail")
        return StopRun(f"{said}; the key may not use this model or route (a guardrail, a key limit, permissions)")
    if status == 404:
        return StopRun(f"{said}; no endpoint serves this model with the run's routing and parameters")
    if status == 413:
        return RequestFailed(said, "too_large")
    if status in (408, 429) or status >= 500:
        return RetryableError(said, retry_after)
    if error.wrapped:
        if error.param in REQUEST_WIDE:
            return StopRun(f"{said}; a setting every request sends is refused: fix it in the config")
        return RequestFailed(said, "provider_refused")
    if error.param in REQUEST_WIDE or REQUEST_WIDE_400.search(error.text):
        return StopRun(f"{said}; a setting every request sends is refused: fix it in the config")
    return RequestFailed(said, "bad_request")


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
