"""In-process transformers generation: the embedded default, on CPU or one GPU node."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from eagle3_datagen.backends.base import Turn
from eagle3_datagen.backends.batching import pad_batch
from eagle3_datagen.backends.hf.model import load_causal_lm
from eagle3_datagen.backends.rendered import RenderedChat


class HFBackend:
    name = "hf"

    def __init__(self, model_path: str | Path, sampling: dict, settings: dict, model_settings: dict):
        self.model = Path(model_path).name
        self.chat = RenderedChat(model_path, model_settings)
        self.tokenizer, self.specials = self.chat.tokenizer, self.chat.specials
        self.lm = load_causal_lm(model_path, settings, model_settings["trust_remote_code"])
        self.sampling = sampling
        self.batch_size = settings["batch_size"]
        self.seed = sampling["seed"]

    def _generation_kwargs(self) -> dict:
        temperature = self.sampling["temperature"]
        kwargs = {
            "max_new_tokens": self.sampling["max_new_tokens"],
            "eos_token_id": self.specials.end_of_turn_id,
            "pad_token_id": self.tokenizer.pad_token_id,
            "do_sample": temperature > 0,
        }
        if temperature > 0:
            kwargs.update(
                temperature=temperature,
                top_p=self.sampling["top_p"],
                top_k=self.sampling["top_k"] or None,
            )
        return kwargs

    @torch.inference_mode()
    def generate(self, conversations: Sequence[list[dict]], tools: Sequence[list[dict] | None]) -> list[Turn]:
        prompts = [self.chat.prompt_ids(c, t) for c, t in zip(conversations, tools, strict=True)]
        # Length-sorted batches keep left padding small.
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        results: list[Turn | None] = [None] * len(prompts)
        kwargs = self._generation_kwargs()
        device = self.lm.device
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            ids, mask = pad_batch([prompts[i] for i in batch], self.tokenizer.pad_token_id, side="left")
            longest = ids.shape[1]
            torch.manual_seed(self.seed + start)
            out = self.lm.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)
            for row, i in enumerate(batch):
                results[i] = self._turn(prompts[i], out[row, longest:].tolist(), conversations[i], tools[i])
        return results

    def _turn(self, prompt_ids: list[int], generated: list[int], history: list[dict], tools: list | None) -> Turn:
        eot = self.specials.end_of_turn_id
        output_ids = generated[: generated.index(eot) + 1] if eot in generated else generated
        # Rows that stopped early are padded after their end-of-turn token; cut there.
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(output_ids)}
        return self.chat.turn(output_ids, prompt_ids, history, tools, usage)
