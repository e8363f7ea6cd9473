"""A vLLM server's OpenAI-compatible `/v1/completions`: our rendering in, the exact token ids back.

The prompt is rendered by the model's own tokenizer and chat template with the generation prompt (the
conversation's tools declared) and sent as a list of token ids, with `return_token_ids` (vLLM 0.32.0's
`CompletionRequest`): the choice's `token_ids` are exactly what the model produced and its
`prompt_token_ids` what it read, checked against ours. Special tokens are kept in the text
(`skip_special_tokens: false`); the turn is parsed from the ids, as for SGLang. vLLM keeps a stop token
id in `token_ids`; `stop_reason` names a matched `stop_token_ids` entry, None for EOS.

In one-pass mode (the section's `one_pass`: backends/vllm/one_pass.py) each request asks the server, started
with hidden-state extraction, to save its prompt's and output's states too; the turn records the file's path
(`produced_by.states_path`), and `finish_shard` stages each conversation's last one beside the responses.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from eagle3_datagen.backends.base import RetryableError, ServerError, Turn, generation_limit
from eagle3_datagen.backends.token_server import TokenServerBackend
from eagle3_datagen.backends.vllm.one_pass import KV_TRANSFER_PARAMS, stage_states


def _check_completion(body: dict) -> None:
    choices = body.get("choices") if isinstance(body, dict) else None
    if not choices or choices[0].get("token_ids") is None:
        raise RetryableError(f"HTTP 200 without choices[0].token_ids: {str(body)[:300]}")
    if choices[0].get("finish_reason") == "abort":
        raise RetryableError("generation aborted by the server")


class VLLMBackend(TokenServerBackend):
    name = "vllm"

    _served_name: str | None = None  # the name the server serves the model under (its /v1/models)

    def __init__(self, model_path, sampling, settings, model_settings, server_alive=None):
        # the workflow's, not the schema's: kept out of the section the fingerprint splits by the schema
        self.one_pass = settings.get("one_pass")
        section = {key: value for key, value in settings.items() if key != "one_pass"}
        super().__init__(model_path, sampling, section, model_settings, server_alive)

    def fingerprint(self) -> dict:
        # a journal of answers that saved no states is not resumed in one-pass mode, nor the reverse
        fingerprint = super().fingerprint()
        if self.one_pass:
            fingerprint["one_pass"] = self.one_pass
        return fingerprint

    def _limits(self, settings: dict, sampling: dict) -> int:
        self.max_tokens = generation_limit(settings, sampling)
        self._slots = asyncio.Semaphore(settings["concurrency"])
        return settings["concurrency"]

    # The settings that cap an answer's length (dotted paths into the fingerprint).
    limit_keys = ("vllm.max_tokens", "sampling.max_new_tokens")

    def limit_for(self, message: dict) -> int:
        return self.max_tokens

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
        if self.one_pass:
            payload["kv_transfer_params"] = KV_TRANSFER_PARAMS
        return payload

    def finish_shard(self, rows: list[dict], out: str | Path) -> None:
        """In one-pass mode, keep the states of each answered conversation beside the shard's responses."""
        if self.one_pass:
            stage_states(rows, out)

    async def generate(self, messages: list[dict], tools: list[dict] | None = None) -> Turn:
        prompt_ids = self.chat.prompt_ids(messages, tools)
        async with self._slots:
            body, attempts, _unbilled = await self.client.post(
                "/v1/completions", self._payload(prompt_ids), _check_completion
            )
        choice = body["choices"][0]
        if choice.get("prompt_token_ids") not in (None, prompt_ids):
            raise ServerError(f"the vLLM server at {self.url} read other prompt ids than it was sent")
        usage = body.get("usage") or {}
        counts = {key: usage[key] for key in ("prompt_tokens", "completion_tokens") if key in usage}
        counts["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        finish = {"type": choice.get("finish_reason"), "matched": choice.get("stop_reason")}
        stop = (finish["type"] == "stop", finish["matched"])
        produced_by = {"attempts": attempts, "finish_reason": finish}
        if self.one_pass:
            saved = (body.get("kv_transfer_params") or {}).get("hidden_states_path")
            if saved is None:
                raise ServerError(
                    f"the vLLM server at {self.url} saved no hidden states (hidden_states.one_pass): was it "
                    "started with the extraction settings?"
                )
            produced_by["states_path"] = saved
        return self._turn(messages, tools, prompt_ids, list(choice["token_ids"]), stop, counts, produced_by)
