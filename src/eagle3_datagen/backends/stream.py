"""An OpenAI-style chat completion streamed as server-sent events (`stream: true`), assembled into the body
a non-streamed request returns.

OpenRouter's stream (its streaming docs): `data: {chunk}` events, each a `chat.completion.chunk` whose
`choices[0].delta` adds to the message (`content`, `reasoning`, `reasoning_details`, `refusal`,
`tool_calls` by index, their `arguments` in pieces); the chunk with `finish_reason` ends the answer; with
`stream_options.include_usage` a last chunk carries `usage` (cost included) and no choice; `data: [DONE]`
ends the stream; lines starting with `:` are keep-alive comments (`: OPENROUTER PROCESSING`). An error after
the first token comes as a chunk with a top-level `error` and `finish_reason: "error"`, the HTTP status
already 200: it is classified as the same error in a body would be (`http.classify`, by its `code`).

What an answer that does not end costs is counted (`lost`): the usage the stream sent where it sent one,
else estimated from what arrived (about four characters a token, the prompt's and the arrived text's) at
the configured prices.
"""

from __future__ import annotations

from eagle3_datagen.backends.base import RetryableError
from eagle3_datagen.backends.http import classify
from eagle3_datagen.formats.spend import Spend

CHARS_PER_TOKEN = 4  # for a cut stream's estimate only: the provider's usage counts where it sent any
STRING_PARTS = ("text", "summary", "data", "signature")  # a reasoning detail's fields a stream sends in pieces


def _error(error: object) -> Exception:
    """A stream's error as the same error in a body would be classified, by the HTTP status its `code`
    names (a code that is none, e.g. `server_error`: a provider's failure, 502)."""
    code = error.get("code") if isinstance(error, dict) else None
    status = code if isinstance(code, int) and 400 <= code < 600 else 502
    return classify(status, {"error": error}, None)


class ChatStream:
    """One streamed answer being assembled: `add` each event's chunk, then `body()`."""

    def __init__(self, prompt_chars: int, prices: dict | None):
        self.prompt_chars = prompt_chars
        self.prices = prices or {}
        self.message: dict = {"role": "assistant", "content": ""}
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.details: list[dict] = []
        self.calls: dict[int, dict] = {}
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.head: dict = {}
        self.started = False  # a chunk arrived: the provider took the request and bills it

    def add(self, chunk: dict) -> None:
        """One event's chunk; raises the error a chunk carries."""
        self.started = True
        for key in ("id", "provider", "model"):
            if chunk.get(key) and key not in self.head:
                self.head[key] = chunk[key]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if chunk.get("error"):
            raise _error(chunk["error"])
        for choice in chunk.get("choices") or ():
            if choice.get("error") or choice.get("finish_reason") == "error":  # the error inside the choice
                raise _error(choice.get("error") or {"message": "the generation ended in an error"})
            self._add_delta(choice.get("delta") or choice.get("message") or {})  # a server that did not stream
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def _add_delta(self, delta: dict) -> None:
        if delta.get("content"):
            self.content.append(delta["content"])
        if delta.get("reasoning"):
            self.reasoning.append(delta["reasoning"])
        if delta.get("refusal"):
            self.message["refusal"] = self.message.get("refusal", "") + delta["refusal"]
        for detail in delta.get("reasoning_details") or ():
            self._add_detail(detail)
        for call in delta.get("tool_calls") or ():
            index = call.get("index", len(self.calls))
            into = self.calls.setdefault(index, {"id": None, "type": "function", "function": {"name": ""}})
            into["id"] = call.get("id") or into["id"]
            function = call.get("function") or {}
            if function.get("name"):
                into["function"]["name"] = function["name"]
            if function.get("arguments") is not None:
                arguments = function["arguments"]
                if isinstance(arguments, str):
                    into["function"]["arguments"] = into["function"].get("arguments", "") + arguments
                else:  # some providers send the arguments whole, as an object
                    into["function"]["arguments"] = arguments

    def _add_detail(self, detail: dict) -> None:
        """A reasoning detail: a piece of the last one of its type and index is joined to it."""
        last = self.details[-1] if self.details else None
        if last is not None and (last.get("type"), last.get("index")) == (detail.get("type"), detail.get("index")):
            for key in STRING_PARTS:
                if isinstance(detail.get(key), str):
                    last[key] = (last.get(key) or "") + detail[key]
            return
        self.details.append(dict(detail))

    @property
    def arrived_chars(self) -> int:
        calls = sum(len(str(c["function"].get("arguments", ""))) for c in self.calls.values())
        return sum(map(len, self.content)) + sum(map(len, self.reasoning)) + calls

    def lost(self) -> Spend:
        """What this answer, not kept, cost: its usage where the stream sent one, else the estimate; nothing
        where no chunk arrived (an error status before the stream: not billed)."""
        if not self.started:
            return Spend()
        return Spend.of_usage(self.usage or self.estimated_usage())

    def estimated_usage(self) -> dict:
        """The usage of what arrived, estimated (a stream that sent none)."""
        prompt = -(-self.prompt_chars // CHARS_PER_TOKEN)
        completion = -(-self.arrived_chars // CHARS_PER_TOKEN)
        per_million = prompt * self.prices.get("prompt", 0.0) + completion * self.prices.get("completion", 0.0)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "cost": per_million / 1e6, "estimated": 1}

    def body(self) -> dict:
        """The non-streamed body this stream amounts to; raises RetryableError where it ended before the
        answer did (no finish_reason)."""
        if self.finish_reason is None:
            raise RetryableError(f"the stream ended after {self.arrived_chars} characters, before the answer did")
        message = {**self.message, "content": "".join(self.content)}
        if self.reasoning:
            message["reasoning"] = "".join(self.reasoning)
        if self.details:
            message["reasoning_details"] = self.details
        if self.calls:
            message["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        usage = self.usage or self.estimated_usage()  # an answer whose stream sent no usage is billed all the same
        return {**self.head, "choices": [{"message": message, "finish_reason": self.finish_reason}], "usage": usage}
