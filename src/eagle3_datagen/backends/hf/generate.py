"""In-process transformers generation: the embedded default, on CPU or one GPU node.

Behind the async interface of the HTTP backends, with batches that never depend on timing
(padding changes float bits): the shard's prompts are planned into fixed groups of
`batch_size`, length-sorted by their first turn, and each turn of a group is one `generate`
call over every live conversation of the group (`LockstepGroup`).
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Sequence
from pathlib import Path

import torch

from eagle3_datagen.backends.base import Turn, journal_fingerprint
from eagle3_datagen.backends.batching import pad_batch
from eagle3_datagen.backends.hf.model import load_causal_lm
from eagle3_datagen.backends.rendered import RenderedChat


class HFBackend:
    """An `AsyncGenerationBackend` with `LockstepGroups`; the model loads once, in the constructor."""

    name = "hf"

    @classmethod
    def for_job(cls, settings: dict, server_alive=None) -> HFBackend:
        """The backend a responses job's settings (plugins.GenerationBackend) configure."""
        return cls(settings["model"]["path"], settings["sampling"], settings["hf"], settings["model"])

    def __init__(self, model_path: str | Path, sampling: dict, settings: dict, model_settings: dict):
        self.model = Path(model_path).name
        self.chat = RenderedChat(model_path, model_settings)
        self.tokenizer, self.specials = self.chat.tokenizer, self.chat.specials
        self.lm = load_causal_lm(model_path, settings, model_settings["trust_remote_code"])
        self.sampling = sampling
        self.settings = settings
        self.batch_size = settings["batch_size"]
        self.concurrency = self.batch_size  # one group in flight
        self.seed = sampling["seed"]
        # Padded positions are masked out; a tokenizer without a pad token (Llama 3.1's) pads with its end of turn.
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.specials.end_of_turn_id

    def fingerprint(self) -> dict:
        # not batch_size or device (run-only): they change float bits, not meaning, and a journal resumes under others
        return journal_fingerprint(
            self.name,
            self.model,
            self.sampling,
            self.settings,
            dtype=str(self.lm.dtype),  # as loaded
            chat_template_kwargs=self.chat.template_kwargs,
        )

    # The setting that caps an answer's length (a dotted path into the fingerprint): a raised one keeps the
    # answers that ended within the old one.
    limit_keys = ("sampling.max_new_tokens",)

    def limit_for(self, message: dict) -> int:
        return self.sampling["max_new_tokens"]

    async def __aenter__(self) -> HFBackend:
        return self

    async def __aexit__(self, *exc) -> None:
        return None

    def groups(self, first_turns: Sequence[tuple[list[dict], list[dict] | None]]) -> list[list[int]]:
        """Groups of `batch_size`, length-sorted by the first turn's prompt: little left padding."""
        lengths = [len(self.chat.prompt_ids(messages, tools)) for messages, tools in first_turns]
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        return [order[start : start + self.batch_size] for start in range(0, len(order), self.batch_size)]

    def group(self, size: int) -> LockstepGroup:
        return LockstepGroup(self, size)

    async def generate(self, messages: list[dict], tools: list[dict] | None = None) -> Turn:
        """One conversation's next turn, in a batch of its own."""
        return await self.group(1).generate(messages, tools)

    @torch.inference_mode()
    def answer(self, requests: Sequence[tuple[list[dict], list[dict] | None]]) -> list[Turn]:
        """The next turn of each conversation (messages, tools), in one left-padded `generate` call."""
        prompts = [self.chat.prompt_ids(messages, tools) for messages, tools in requests]
        # Rows in an order and a seed that depend on the prompts alone, not on who asked first.
        order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), prompts[i]))
        ids, mask = pad_batch([prompts[i] for i in order], self.pad_id, side="left")
        torch.manual_seed(self.seed + zlib.crc32(ids.numpy().tobytes()))
        device = self.lm.device
        out = self.lm.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **self._generation_kwargs())
        turns: list[Turn | None] = [None] * len(prompts)
        for row, i in enumerate(order):
            turns[i] = self._turn(prompts[i], out[row, ids.shape[1] :].tolist(), *requests[i])
        return turns

    def _generation_kwargs(self) -> dict:
        temperature = self.sampling["temperature"]
        kwargs = {
            "max_new_tokens": self.sampling["max_new_tokens"],
            "eos_token_id": self.specials.stop_ids,
            "pad_token_id": self.pad_id,
            "do_sample": temperature > 0,
        }
        if temperature > 0:
            kwargs.update(
                temperature=temperature,
                top_p=self.sampling["top_p"],
                top_k=self.sampling["top_k"] or None,
            )
        return kwargs

    def _turn(self, prompt_ids: list[int], generated: list[int], history: list[dict], tools: list | None) -> Turn:
        # Rows that stopped early are padded after their stop token (end of turn, or a call's end); cut there.
        stop = next((i for i, token in enumerate(generated) if token in self.specials.stop_ids), None)
        output_ids = generated if stop is None else generated[: stop + 1]
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(output_ids)}
        return self.chat.turn(output_ids, prompt_ids, history, tools, usage)


class LockstepGroup:
    """A group's conversations in lockstep: a batch runs once every live one has asked for its
    next turn or left, as the steps of a synchronous loop would, whatever order they came in."""

    def __init__(self, backend: HFBackend, size: int):
        self.backend = backend
        self.live = size
        self.waiting: list[tuple[list[dict], list[dict] | None, asyncio.Future]] = []

    async def generate(self, messages: list[dict], tools: list[dict] | None) -> Turn:
        answered = asyncio.get_running_loop().create_future()
        self.waiting.append((messages, tools, answered))
        self._run_when_all_asked()
        return await answered

    async def leave(self) -> None:
        self.live -= 1
        self._run_when_all_asked()

    def _run_when_all_asked(self) -> None:
        if not self.waiting or len(self.waiting) < self.live:
            return
        batch, self.waiting = self.waiting, []
        # On the event loop's thread: the driver runs one group at a time, so nothing else waits on
        # the loop, and Ctrl-C stops the batch at once (a worker thread would finish it first). An
        # error propagates from the conversation that started the batch and ends the job.
        turns = self.backend.answer([(messages, tools) for messages, tools, _ in batch])
        for (*_, answered), turn in zip(batch, turns, strict=True):
            answered.set_result(turn)
