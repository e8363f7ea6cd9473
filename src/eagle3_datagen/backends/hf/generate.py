"""In-process transformers generation: the embedded default, on CPU or one GPU node."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from eagle3_datagen.backends.base import Turn, finish_reason
from eagle3_datagen.backends.hf.model import load_causal_lm
from eagle3_datagen.backends.rendered import ToolCallReader
from eagle3_datagen.chat.template import (
    load_tokenizer,
    render_generation_prompt,
    resolve_special_tokens,
    split_output_ids,
)


class HFBackend:
    name = "hf"

    def __init__(self, model_path: str | Path, sampling: dict, settings: dict, model_settings: dict):
        self.model = Path(model_path).name
        trust = model_settings.get("trust_remote_code", False)
        self.tokenizer = load_tokenizer(model_path, trust)
        self.template_kwargs = model_settings.get("chat_template_kwargs") or {}
        self.specials = resolve_special_tokens(
            self.tokenizer, model_settings.get("special_tokens"), self.template_kwargs
        )
        self.tool_calls = ToolCallReader(self.tokenizer, self.template_kwargs)
        self.lm = load_causal_lm(model_path, settings, trust)
        self.sampling = sampling
        self.batch_size = settings.get("batch_size", 8)
        self.seed = sampling.get("seed", 0)

    def _generation_kwargs(self) -> dict:
        temperature = self.sampling.get("temperature", 0.0)
        kwargs = {
            "max_new_tokens": self.sampling["max_new_tokens"],
            "eos_token_id": self.specials.end_of_turn_id,
            "pad_token_id": self.tokenizer.pad_token_id,
            "do_sample": temperature > 0,
        }
        if temperature > 0:
            kwargs.update(
                temperature=temperature,
                top_p=self.sampling.get("top_p", 1.0),
                top_k=self.sampling.get("top_k", 0) or None,
            )
        return kwargs

    @torch.inference_mode()
    def generate(self, conversations: Sequence[list[dict]], tools: Sequence[list[dict] | None]) -> list[Turn]:
        for declared in tools:
            self.tool_calls.check(declared)
        prompts = [
            render_generation_prompt(self.tokenizer, c, t, self.template_kwargs)
            for c, t in zip(conversations, tools, strict=True)
        ]
        # Length-sorted batches keep left padding small.
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        results: list[Turn | None] = [None] * len(prompts)
        kwargs = self._generation_kwargs()
        device = self.lm.device
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            longest = max(len(prompts[i]) for i in batch)
            ids = torch.full((len(batch), longest), self.tokenizer.pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, i in enumerate(batch):
                ids[row, longest - len(prompts[i]) :] = torch.tensor(prompts[i])
                mask[row, longest - len(prompts[i]) :] = 1
            torch.manual_seed(self.seed + start)
            out = self.lm.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)
            for row, i in enumerate(batch):
                results[i] = self._turn(prompts[i], out[row, longest:].tolist(), conversations[i], tools[i])
        return results

    def _turn(self, prompt_ids: list[int], generated: list[int], history: list[dict], tools: list | None) -> Turn:
        eot = self.specials.end_of_turn_id
        output_ids = generated[: generated.index(eot) + 1] if eot in generated else generated
        # Rows that stopped early are padded after their end-of-turn token; cut there.
        parsed = split_output_ids(self.tokenizer, output_ids, self.specials, prompt_ids)
        content, calls, calls_malformed = self.tool_calls.split(parsed.content, history, tools)
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(output_ids)}
        return Turn(
            content=content,
            reasoning=parsed.reasoning,
            finish_reason=finish_reason(parsed.stopped, calls),
            usage=usage,
            output_ids=output_ids,
            malformed="think_block" if not parsed.well_formed else calls_malformed,
            tool_calls=calls or None,
        )
