"""A local SGLang server's native `/generate`: our rendering in, the exact output IDs back.

The prompt is rendered by the model's own tokenizer and chat template with the generation
prompt (the conversation's tools declared to the template) and sent as `input_ids`, so the
response's `output_ids` are exactly what the model produced; tool calls are read from them as
SGLang's own `kimi_k2` parser reads them (`chat.tool_calls.ToolCallMarkers`). Prompts up to
`tiers.short.max_prompt_tokens` go through the short tier (high concurrency, smaller max
tokens), longer ones through the long tier.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from eagle3_datagen.backends.base import RetryableError, ServerError, Turn, generation_limit
from eagle3_datagen.backends.service import launch_args
from eagle3_datagen.backends.token_server import TokenServerBackend


@dataclass(frozen=True)
class Tier:
    name: str
    concurrency: int
    max_tokens: int
    max_prompt_tokens: int | None = None  # None: no limit (the long tier)


# The node's server is sent input_ids and read for output_ids and meta_info only: without its tokenizer, SGLang
# neither loads it (three times: the HTTP process, the scheduler, the detokenizer) nor detokenizes each answer.
# Measured on the CPU (0.5.23, the tests' tiny Qwen3 with the real Qwen3 tokenizer): ready in 18 s, 22 CPU s,
# against 41 s and 57 CPU s with it. It refuses string stops and min_new_tokens, which no request here sends.
SKIP_TOKENIZER = "--skip-tokenizer-init"


def launch_args_for(settings: dict) -> list[str]:
    """The flags the node's launched server takes after `launch.args` (its registry entry's launch_extras):
    --skip-tokenizer-init, unless the user's flags already hold it."""
    launch = settings["sglang"]["launch"]
    return [] if SKIP_TOKENIZER in [*launch_args(launch), *launch["run_args"]] else [SKIP_TOKENIZER]


def tiers_from_config(settings: dict, sampling: dict) -> tuple[Tier, Tier]:
    """The tiers of `settings` (inference.sglang); a tier without max_tokens takes sampling.max_new_tokens."""
    short, long = settings["tiers"]["short"], settings["tiers"]["long"]
    return (
        Tier("short", short["concurrency"], generation_limit(short, sampling), short["max_prompt_tokens"]),
        Tier("long", long["concurrency"], generation_limit(long, sampling)),
    )


def _check_generation(body: dict) -> None:
    if body.get("error") or "output_ids" not in body:
        raise RetryableError(f"HTTP 200 without output_ids: {str(body)[:300]}")
    finish = (body.get("meta_info") or {}).get("finish_reason") or {}
    if finish.get("type") == "abort":
        raise RetryableError(f"generation aborted by the server: {finish.get('message', '')}")


class SGLangBackend(TokenServerBackend):
    name = "sglang"

    def _limits(self, settings: dict, sampling: dict) -> int:
        """The two tiers, each with its own slots; a job has both tiers' requests in flight."""
        self.short, self.long = tiers_from_config(settings, sampling)
        self._slots = {
            self.short.name: asyncio.Semaphore(self.short.concurrency),
            self.long.name: asyncio.Semaphore(self.long.concurrency),
        }
        return self.short.concurrency + self.long.concurrency

    # The settings that cap an answer's length (dotted paths into the fingerprint): a raised one keeps the
    # answers that ended within the old one.
    limit_keys = ("sglang.tiers.short.max_tokens", "sglang.tiers.long.max_tokens", "sampling.max_new_tokens")

    def limit_for(self, message: dict) -> int:
        """The token limit a recorded turn would be answered under now: its tier's (a tier is chosen by the
        prompt's length, which the fingerprint holds)."""
        tier = (message.get("produced_by") or {}).get("tier")
        return self.long.max_tokens if tier == self.long.name else self.short.max_tokens

    async def _check_model(self) -> None:
        _, info = await self.client.get("/model_info")  # 0.5.23 deprecates /get_model_info for it
        served = Path(str((info or {}).get("model_path", ""))).name
        if served != self.model:
            raise ServerError(
                f"the SGLang server at {self.url} serves {info.get('model_path')!r}, not the configured model "
                f"{self.model!r} (model.path {self.model_path}); set inference.sglang.served_model if the names differ"
            )

    def tier_for(self, prompt_tokens: int) -> Tier:
        return self.short if prompt_tokens <= self.short.max_prompt_tokens else self.long

    def _payload(self, prompt_ids: list[int], tier: Tier) -> dict:
        return {
            "input_ids": prompt_ids,
            "sampling_params": {
                # The server's default is 128: always send it.
                "max_new_tokens": tier.max_tokens,
                "temperature": self.sampling["temperature"],
                "top_p": self.sampling["top_p"],
                "top_k": self.sampling["top_k"] or -1,
                "stop_token_ids": self.specials.stop_ids,
                "skip_special_tokens": False,
                "no_stop_trim": True,
            },
        }

    async def generate(self, messages: list[dict], tools: list[dict] | None = None) -> Turn:
        prompt_ids = self.chat.prompt_ids(messages, tools)
        tier = self.tier_for(len(prompt_ids))
        async with self._slots[tier.name]:
            payload = self._payload(prompt_ids, tier)
            body, attempts, _unbilled = await self.client.post("/generate", payload, _check_generation)
        meta = body.get("meta_info") or {}
        finish = meta.get("finish_reason") or {}
        stop = (finish.get("type") == "stop", finish.get("matched"))
        counts = {key: meta[key] for key in ("prompt_tokens", "completion_tokens", "cached_tokens") if key in meta}
        produced_by = {"tier": tier.name, "attempts": attempts, "finish_reason": finish}
        return self._turn(messages, tools, prompt_ids, list(body["output_ids"]), stop, counts, produced_by)
