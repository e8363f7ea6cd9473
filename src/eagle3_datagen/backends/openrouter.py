"""OpenRouter's OpenAI-compatible chat completions: text only, priced, highly concurrent.

Tools are declared in the request's `tools`; the calls the model makes come back in
`message.tool_calls` and are stored with Kimi's call ids (`functions.{name}:{index}`), which
is also how the history sends them back.

The API key is read from the environment variable named by `api_key_env` and lives only in
the HTTP session's headers: never in settings, logs, outputs or error messages.

How many requests are in flight is the responses driver's business (its share of the run's
`concurrency`, `stages.responses.limits`): one request per conversation in flight.

What the gates of later stages read is recorded as the provider sent it: the raw `finish_reason`
(e.g. `content_filter`, which the turn's own `finish_reason` counts as a stop) in `produced_by`, and
`message.refusal`, when the provider sends one, as the assistant message's `refusal`.

Answers are streamed (`stream`, the default; `backends/stream.py`) so that a long slow answer is bounded by
`idle_timeout` between chunks, not by a total; the usage comes in the stream's last chunk. What failed
attempts were billed (a stream cut or ended by an error, a 200 carrying an error) is kept on the turn
(`usage.lost_tokens`, `usage.lost_cost`) or, where the prompt fails, on its row, and counted in the spend.
"""

from __future__ import annotations

import functools
import json
import os

from eagle3_datagen.backends.base import (
    MissingApiKey,
    RetryableError,
    Turn,
    finish_reason,
    generation_limit,
    journal_fingerprint,
)
from eagle3_datagen.backends.client import JsonClient
from eagle3_datagen.backends.http import RetryPolicy
from eagle3_datagen.backends.stream import ChatStream
from eagle3_datagen.chat.tool_calls import calls_before, openai_call
from eagle3_datagen.formats.spend import Spend

MAX_CONCURRENCY = 2000


def _check_completion(body: dict) -> None:
    """A 200 can still be a failed generation: an `error` object, or no usable choice (billed where its usage
    says so)."""
    lost = Spend.of_usage(body.get("usage"))
    if body.get("error"):
        raise RetryableError(f"HTTP 200 with error: {body['error']}", lost=lost)
    choices = body.get("choices") or []
    if not choices or choices[0].get("message") is None:
        raise RetryableError("HTTP 200 with no choice", lost=lost)
    if choices[0].get("finish_reason") == "error" or choices[0].get("error"):
        raise RetryableError(f"HTTP 200, generation error: {choices[0].get('error')}", lost=lost)


class OpenRouterBackend:
    name = "openrouter"

    @classmethod
    def for_job(cls, settings: dict, server_alive=None) -> OpenRouterBackend:
        """The backend a responses job's settings (plugins.GenerationBackend) configure."""
        return cls(settings["sampling"], settings["openrouter"])

    def __init__(self, sampling: dict, settings: dict):
        key_env = settings["api_key_env"]
        key = os.environ.get(key_env)
        if not key:
            raise MissingApiKey(f"the environment variable {key_env} is not set; export the OpenRouter API key there")
        self.model = settings["model"]
        self.sampling = sampling
        self.settings = settings
        self.max_tokens = generation_limit(settings, sampling)
        self.concurrency = min(settings["concurrency"], MAX_CONCURRENCY)
        self.provider = settings.get("provider")  # absent: no provider routing
        self.reasoning = settings["reasoning"]
        self.stream = settings["stream"]
        self.prices = settings.get("price_per_million")  # absent: a cut stream's estimate costs nothing
        self.client = JsonClient(
            settings["base_url"],
            self.concurrency,
            settings["request_timeout"],
            RetryPolicy.from_config(settings["retry"]),
            headers={"Authorization": f"Bearer {key}"},
            idle_timeout_s=settings["idle_timeout"],
        )

    # The settings that cap an answer's length (dotted paths into the fingerprint): a raised one keeps the
    # answers that ended within the old one.
    limit_keys = ("openrouter.max_tokens", "sampling.max_new_tokens")

    def limit_for(self, message: dict) -> int:
        """The token limit a recorded turn would be answered under now."""
        return self.max_tokens

    def fingerprint(self) -> dict:
        return journal_fingerprint(self.name, self.model, self.sampling, self.settings)

    async def __aenter__(self) -> OpenRouterBackend:
        await self.client.open()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.close()

    def _payload(self, messages: list[dict], tools: list[dict] | None) -> dict:
        payload = {
            "model": self.model,
            "messages": [request_message(m) for m in messages],
            "max_tokens": self.max_tokens,
            "temperature": self.sampling["temperature"],
            "top_p": self.sampling["top_p"],
            "reasoning": self.reasoning,
        }
        if self.sampling["top_k"]:
            payload["top_k"] = self.sampling["top_k"]
        payload["seed"] = self.sampling["seed"]
        if self.provider:
            payload["provider"] = self.provider
        if tools:
            payload["tools"] = tools
        if self.stream:
            payload["stream"] = True
            payload["stream_options"] = {"include_usage": True}
        return payload

    async def generate(self, messages: list[dict], tools: list[dict] | None = None) -> Turn:
        payload = self._payload(messages, tools)
        if self.stream:
            prompt_chars = sum(len(str(m.get("content") or "")) for m in messages)
            new_stream = functools.partial(ChatStream, prompt_chars, self.prices)
            body, attempts, lost = await self.client.post_stream("/chat/completions", payload, new_stream)
        else:
            body, attempts, lost = await self.client.post("/chat/completions", payload, _check_completion)
        choice = body["choices"][0]
        message = choice["message"]
        usage = body.get("usage") or {}
        details = usage.get("completion_tokens_details") or {}
        first = calls_before(messages)
        calls = [
            openai_call(call["function"]["name"], _arguments(call["function"].get("arguments")), first + i)
            for i, call in enumerate(message.get("tool_calls") or ())
        ]
        extra = {key: message[key] for key in ("reasoning_details", "refusal") if message.get(key)}
        return Turn(
            content=message.get("content") or "",
            reasoning=message.get("reasoning") or "",
            finish_reason=finish_reason(choice.get("finish_reason") != "length", calls),
            tool_calls=calls or None,
            usage={
                "prompt_tokens": usage.get("prompt_tokens", 0),
                "completion_tokens": usage.get("completion_tokens", 0),
                "reasoning_tokens": details.get("reasoning_tokens", 0),
                "cost": usage.get("cost", 0.0),
                **({"estimated": 1} if usage.get("estimated") else {}),
                **({"lost_tokens": lost.tokens, "lost_cost": lost.cost} if lost else {}),
            },
            extra={
                **extra,
                "produced_by": {
                    "backend": self.name,
                    "provider": body.get("provider"),
                    "model": body.get("model"),
                    "attempts": attempts,
                    "finish_reason": choice.get("finish_reason"),
                },
            },
        )


def request_message(message: dict) -> dict:
    """A history message as the chat API takes it: calls, results and reasoning details kept."""
    sent = {"role": message["role"], "content": message["content"]}
    for key in ("tool_calls", "tool_call_id", "name", "reasoning_details"):
        if message.get(key):
            sent[key] = message[key]
    return sent


def _arguments(arguments) -> str:
    """A call's arguments as a JSON string (some providers send an object, or nothing)."""
    if isinstance(arguments, str):
        return arguments or "{}"
    return json.dumps(arguments if arguments is not None else {})
