"""A vLLM server's OpenAI-compatible `/v1/completions`: our rendering in, the exact token ids back.

The prompt is rendered by the model's own tokenizer and chat template with the generation prompt (the
conversation's tools declared) and sent as a list of token ids, with `return_token_ids` (vLLM 0.32.0's
`CompletionRequest`): the choice's `token_ids` are exactly what the model produced and its
`prompt_token_ids` what it read, checked against ours. Special tokens are kept in the text
(`skip_special_tokens: false`); the turn is parsed from the ids, as for SGLang.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from eagle3_datagen.backends.base import (
    RetryableError,
    ServerError,
    ServerGone,
    Turn,
    generation_limit,
    journal_fingerprint,
)
from eagle3_datagen.backends.client import JsonClient
from eagle3_datagen.backends.http import RetryPolicy
from eagle3_datagen.backends.rendered import RenderedChat
from eagle3_datagen.backends.service.supervise import wait_healthy

log = logging.getLogger(__name__)


def _check_completion(body: dict) -> None:
    choices = body.get("choices") if isinstance(body, dict) else None
    if not choices or choices[0].get("token_ids") is None:
        raise RetryableError(f"HTTP 200 without choices[0].token_ids: {str(body)[:300]}")
    if choices[0].get("finish_reason") == "abort":
        raise RetryableError("generation aborted by the server")


def output_ids(choice: dict, stop_ids: list[int]) -> list[int]:
    """The choice's generated ids, ending with the stop token where a stop token ended it (vLLM keeps a
    stop token id in `token_ids`; `stop_reason` names a matched `stop_token_ids` entry, None for EOS)."""
    ids = list(choice["token_ids"])
    matched = choice.get("stop_reason")
    if choice.get("finish_reason") == "stop" and matched in stop_ids and ids[-1:] != [matched]:
        ids.append(matched)
    return ids


class VLLMBackend:
    name = "vllm"

    @classmethod
    def for_job(cls, settings: dict, server_alive=None) -> VLLMBackend:
        """The backend a responses job's settings (plugins.GenerationBackend) configure; `server_alive`:
        whether the server this job launched still runs (None: not launched here)."""
        return cls(settings["model"]["path"], settings["sampling"], settings["vllm"], settings["model"], server_alive)

    def __init__(
        self,
        model_path: str | Path,
        sampling: dict,
        settings: dict,
        model_settings: dict,
        server_alive: Callable[[], bool] | None = None,
    ):
        self.model_path = Path(model_path)
        self.model = settings.get("served_model") or self.model_path.name
        self.chat = RenderedChat(model_path, model_settings)
        self.specials = self.chat.specials
        self.sampling = sampling
        self.settings = settings
        self.max_tokens = generation_limit(settings, sampling)
        self.concurrency = settings["concurrency"]
        self.url = settings["url"]
        self.health_timeout = settings["health_timeout"]
        self.client = JsonClient(
            self.url,
            self.concurrency,
            settings["request_timeout"],
            RetryPolicy.from_config(settings["retry"]),
            server_alive=server_alive,
        )
        self._slots = asyncio.Semaphore(self.concurrency)
        self._served_name: str | None = None

    def fingerprint(self) -> dict:
        # not the concurrency (run-only): a journal resumes under another one
        return journal_fingerprint(
            self.name, self.model, self.sampling, self.settings, chat_template_kwargs=self.chat.template_kwargs
        )

    # The settings that cap an answer's length (dotted paths into the fingerprint).
    limit_keys = ("vllm.max_tokens", "sampling.max_new_tokens")

    def limit_for(self, message: dict) -> int:
        return self.max_tokens

    async def __aenter__(self) -> VLLMBackend:
        await self.client.open()
        if self.client.server_alive is not None and not self.client.server_alive():
            raise ServerGone(f"the server at {self.url} is gone")  # died between two shards of the job
        await asyncio.to_thread(wait_healthy, self.url, self.health_timeout)
        await self._check_model()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.close()

    async def _check_model(self) -> None:
        _, listing = await self.client.get("/v1/models")
        served = [entry.get("id", "") for entry in (listing or {}).get("data", [])]
        for name in served:
            if Path(name).name == self.model:
                self._served_name = name  # the request's `model` is the name the server serves it under
                return
        raise ServerError(
            f"the vLLM server at {self.url} serves {served}, not the configured model {self.model!r} "
            f"(model.path {self.model_path}); set inference.vllm.served_model if the names differ"
        )

    def _payload(self, prompt_ids: list[int]) -> dict:
        payload = {
            "model": self._served_name,
            "prompt": prompt_ids,
            # The request's default is 16: always send it.
            "max_tokens": self.max_tokens,
            "temperature": self.sampling["temperature"],
            "top_p": self.sampling["top_p"],
            "top_k": self.sampling["top_k"] or 0,  # 0: off
            "stop_token_ids": self.specials.stop_ids,
            "skip_special_tokens": False,
            "return_token_ids": True,
        }
        if self.sampling.get("seed") is not None and self.sampling["temperature"] > 0:
            payload["seed"] = self.sampling["seed"]
        return payload

    async def generate(self, messages: list[dict], tools: list[dict] | None = None) -> Turn:
        prompt_ids = self.chat.prompt_ids(messages, tools)
        async with self._slots:
            body, attempts, _unbilled = await self.client.post(
                "/v1/completions", self._payload(prompt_ids), _check_completion
            )
        choice = body["choices"][0]
        if choice.get("prompt_token_ids") not in (None, prompt_ids):
            raise ServerError(f"the vLLM server at {self.url} read other prompt ids than it was sent")
        ids = output_ids(choice, self.specials.stop_ids)
        usage_in = body.get("usage") or {}
        think_end = self.specials.think_end_id
        usage = {
            "prompt_tokens": usage_in.get("prompt_tokens", len(prompt_ids)),
            "completion_tokens": usage_in.get("completion_tokens", len(ids)),
            "cached_tokens": (usage_in.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
            "reasoning_tokens": ids.index(think_end) + 1 if think_end in ids else 0,
        }
        finish = {"type": choice.get("finish_reason"), "matched": choice.get("stop_reason")}
        produced_by = {"backend": self.name, "attempts": attempts, "finish_reason": finish}
        return self.chat.turn(ids, prompt_ids, messages, tools, usage, {"produced_by": produced_by})
