"""What every backend shares: the generated `Turn`, the generation and capture interfaces, the errors.

Generation has one interface, `AsyncGenerationBackend`: one conversation turn per call, many in
flight (HTTP servers: SGLang, OpenRouter). In-process transformers (`hf`) adds `LockstepGroups`:
its batches must not depend on timing, so its conversations run in fixed groups, each turn one
batch of a group's live conversations. Capture has one interface: `CaptureBackend`, called with
a batch of token ID lists, in lockstep over `Ranks` when tensor parallel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from eagle3_datagen.config_schema import split
from eagle3_datagen.formats.spend import Spend

if TYPE_CHECKING:
    import torch


def journal_fingerprint(name: str, model: str, sampling: dict, section: dict, **resolved) -> dict:
    """A generation backend's journal fingerprint, what shapes its responses: its section's output-shaping
    settings (`x-kind: output` in the schema, so a new one is in it with no code here; the section's own
    `sampling` is in `sampling`, the merged one it generates with), under its name; the model it asks; and
    what it resolved from them (`resolved`: the dtype as loaded, the template's switches)."""
    own = split(section, f"inference.{name}")[0]
    own.pop("sampling", None)
    return {"backend": name, "model": model, "sampling": sampling, name: own, **resolved}


@dataclass
class Turn:
    """One generated assistant turn as a backend returns it."""

    content: str
    reasoning: str
    finish_reason: str  # "stop" | "length" | "tool_calls"
    usage: dict
    output_ids: list[int] | None = None
    malformed: str | None = None  # why the output cannot be rendered back, e.g. "think_block"
    tool_calls: list[dict] | None = None  # OpenAI layout, Kimi ids
    extra: dict = field(default_factory=dict)

    def as_message(self, turn_index: int) -> dict:
        message = {
            "role": "assistant",
            "content": self.content,
            "reasoning": self.reasoning,
            "finish_reason": self.finish_reason,
            "usage": self.usage,
            "turn": turn_index,
            **self.extra,
        }
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        if self.output_ids is not None:
            message["output_ids"] = self.output_ids
        if self.malformed:
            message["malformed"] = self.malformed
        return message

    @property
    def status(self) -> str:
        if self.finish_reason not in ("stop", "tool_calls"):
            return "truncated"
        return "malformed" if self.malformed else "ok"


def generation_limit(section: dict, sampling: dict) -> int:
    """The most tokens a turn may have under `section` (a backend's settings or an SGLang tier): its
    `max_tokens`, absent the sampling's `max_new_tokens` (no schema default: it follows another key)."""
    return section.get("max_tokens") or sampling["max_new_tokens"]


def finish_reason(stopped: bool, tool_calls: list[dict] | None) -> str:
    if not stopped:
        return "length"
    return "tool_calls" if tool_calls else "stop"


@runtime_checkable
class AsyncGenerationBackend(Protocol):
    """Generates one conversation's next turn per call, `concurrency` calls in flight (HTTP: `sglang`,
    `openrouter`). Used as an async context manager around the calls (it opens its session there)."""

    name: str
    model: str
    concurrency: int  # conversations in flight
    limit_keys: tuple[str, ...]  # the fingerprint's length limits, as dotted paths (a number indexes a list)

    def fingerprint(self) -> dict:
        """The settings that shape a response (a journal written under others is not reused, but for the
        answers a changed length limit would give again)."""
        ...

    def limit_for(self, message: dict) -> int:
        """The token limit a recorded assistant turn (`message`) would be generated under now."""
        ...

    async def __aenter__(self) -> AsyncGenerationBackend: ...

    async def __aexit__(self, *exc) -> None: ...

    async def generate(self, messages: list[dict], tools: list[dict] | None) -> Turn:
        """The next assistant turn with `tools` declared.

        Raises RequestFailed (this prompt fails), RetryableError (retries spent) or StopRun (no
        request can succeed any more).
        """
        ...


class ConversationGroup(Protocol):
    """One group of a `LockstepGroups` backend: its conversations ask for their turns here."""

    async def generate(self, messages: list[dict], tools: list[dict] | None) -> Turn:
        """This conversation's next turn, answered in the batch of every live conversation of the group."""
        ...

    async def leave(self) -> None:
        """This conversation is done: the group's batches go on without it."""
        ...


@runtime_checkable
class LockstepGroups(Protocol):
    """An `AsyncGenerationBackend` whose batch composition is a function of its inputs, never of
    timing (padding changes float bits): the driver runs one group at a time, as planned over
    every prompt of a shard, so a rerun that skips finished groups batches the rest as an
    uninterrupted run does."""

    def groups(self, first_turns: Sequence[tuple[list[dict], list[dict] | None]]) -> list[list[int]]:
        """The conversations (indices into `first_turns`: each one's messages and tools up to its
        first answer) that run together."""
        ...

    def group(self, size: int) -> ConversationGroup:
        """A group of `size` conversations: a batch runs once each live one has asked or left."""
        ...


@runtime_checkable
class Ranks(Protocol):
    """The lockstep interface of a capture: one process (`SingleProcess`) or tensor-parallel ranks,
    every rank running the same forward passes and one of them (the writer) writing the files."""

    writer: bool  # this rank writes files and receives the states

    def agree(self, value):
        """The writer's `value`, on every rank (rank 0 decides, e.g. which parts are already done)."""
        ...


class SingleProcess:
    """`Ranks` for a capture that runs in one process: it writes, and agrees with itself."""

    writer = True

    def agree(self, value):
        return value


@runtime_checkable
class CaptureBackend(Protocol):
    """One prefill of the target model that returns the EAGLE-3 states of every token.

    `aux_layers` are transformers `hidden_states` indices (embedding output = 0); `final` is
    `normed` (the final norm's output, what the LM head sees) or `raw` (layer N's output).
    """

    packed: bool  # batches are one flat sequence (budget tokens), not padded rows (budget rows x longest)
    ranks: Ranks
    model_name: str
    num_layers: int
    hidden_size: int
    aux_layers: list[int]
    final: str
    model: torch.nn.Module  # the model as loaded (the layer check's hooks go on its layers)

    def __call__(self, batch: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per sample of `batch` (token ID lists): (aux [T, A*H], final [T, H]) on the CPU, in
        order, on the writer rank; on other ranks the forward pass only (an empty list)."""
        ...


class RetryableError(Exception):
    """A request that may succeed when tried again (408, 429, 5xx, a 200 that carries an error). `lost`: what
    the attempts that failed were billed (set by the client, summed over them)."""

    def __init__(self, reason: str, retry_after: float | None = None, lost: Spend | None = None):
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after
        self.lost = lost or Spend()


class RequestFailed(Exception):
    """The provider refuses this prompt and would refuse it again (its length, its content): the prompt is
    recorded as failed, with `kind`, a short stable reason (`context_overflow`, `moderation`, ...), and
    `reason`, the provider's own words; never retried. `lost`: what the request's attempts were billed."""

    def __init__(self, reason: str, kind: str = "bad_request", lost: Spend | None = None):
        super().__init__(reason)
        self.reason = reason
        self.kind = kind
        self.lost = lost or Spend()


class StopRun(Exception):
    """No further request can succeed; the message says what to do."""


class ServerGone(StopRun):
    """The server this job started (the node's service) exited, or was killed as hung, with requests in
    flight: none of them is recorded, and the job may start it again."""


class MissingApiKey(RuntimeError):
    """The API key's environment variable is not set: no request is sent."""


class ServerError(RuntimeError):
    """The model server is not there, not healthy, or serves another model."""
