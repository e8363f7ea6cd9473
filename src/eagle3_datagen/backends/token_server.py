"""What the generation backends that talk to a token-id server (SGLang's `/generate`, vLLM's
`/v1/completions`) share: the rendered chat, the JSON client to the server, the journal's fingerprint,
the server's health and served model checked on entry (a launched one's death, or its kill as hung,
ending the wait), and the returned ids read back into a `Turn`. A backend adds its payload, its
concurrency (tiers or one pool), its model check and its response parsing."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from eagle3_datagen.backends.base import ServerError, ServerGone, Turn, journal_fingerprint
from eagle3_datagen.backends.client import JsonClient
from eagle3_datagen.backends.http import RetryPolicy
from eagle3_datagen.backends.rendered import RenderedChat
from eagle3_datagen.backends.service.supervise import wait_healthy


class TokenServerBackend:
    """An `AsyncGenerationBackend` whose server reads the prompt's token ids and returns the generated ids.

    `name`: the backend's registry name, also its section of a responses job's settings (`inference.<name>`);
    `concurrency`: the requests in flight per job (the client's connections), as `_limits` sets them."""

    name: str

    @classmethod
    def for_job(cls, settings: dict, server_alive=None) -> TokenServerBackend:
        """The backend a responses job's settings (plugins.GenerationBackend) configure; `server_alive`:
        whether the server this job launched still runs (None: not launched here)."""
        return cls(settings["model"]["path"], settings["sampling"], settings[cls.name], settings["model"], server_alive)

    def __init__(
        self,
        model_path: str | Path,
        sampling: dict,
        settings: dict,
        model_settings: dict,
        server_alive: Callable[[], bool] | None = None,
    ):
        """`server_alive`: for the server this job launched, whether it still runs (see JsonClient)."""
        self.model_path = Path(model_path)
        self.model = settings.get("served_model") or self.model_path.name
        self.chat = RenderedChat(model_path, model_settings)
        self.specials = self.chat.specials
        self.sampling = sampling
        self.settings = settings
        self.concurrency = self._limits(settings, sampling)
        self.url = settings["url"]
        self.health_timeout = settings["health_timeout"]
        self.client = JsonClient(
            self.url,
            self.concurrency,
            settings["request_timeout"],
            RetryPolicy.from_config(settings["retry"]),
            server_alive=server_alive,
        )

    def fingerprint(self) -> dict:
        # not the concurrency (run-only): a journal resumes under another one
        return journal_fingerprint(
            self.name, self.model, self.sampling, self.settings, chat_template_kwargs=self.chat.template_kwargs
        )

    async def __aenter__(self) -> TokenServerBackend:
        await self.client.open()
        alive = self.client.server_alive
        try:
            # a launched server that dies, or is killed as hung, ends the wait (not health_timeout s later)
            await asyncio.to_thread(wait_healthy, self.url, self.health_timeout, alive)
            await self._check_model()
        except BaseException as e:
            await self.client.close()
            if isinstance(e, ServerError) and alive is not None and not alive():
                raise ServerGone(f"the server at {self.url} is gone") from None
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.close()

    def _limits(self, settings: dict, sampling: dict) -> int:
        """Set the backend's generation limits and request slots from its `settings` section; return the
        requests in flight per job."""
        raise NotImplementedError

    async def _check_model(self) -> None:
        """Raise ServerError unless the server serves the configured model."""
        raise NotImplementedError

    def _turn(
        self,
        messages: list[dict],
        tools: list[dict] | None,
        prompt_ids: list[int],
        output_ids: list[int],
        stop: tuple[bool, int | None],
        counts: dict,
        produced_by: dict,
    ) -> Turn:
        """The server's answer as a turn. `stop`: (whether a stop ended it, the stop id it matched: None for
        EOS), the matched id appended where the server left it out; `counts`: the server's prompt, completion
        and cached token counts (absent: counted here); `produced_by`: the backend's record of the request."""
        stopped, matched = stop
        if stopped and matched in self.specials.stop_ids and output_ids[-1:] != [matched]:
            output_ids = [*output_ids, matched]
        think_end = self.specials.think_end_id
        usage = {
            "prompt_tokens": counts.get("prompt_tokens", len(prompt_ids)),
            "completion_tokens": counts.get("completion_tokens", len(output_ids)),
            "cached_tokens": counts.get("cached_tokens") or 0,
            "reasoning_tokens": output_ids.index(think_end) + 1 if think_end in output_ids else 0,
        }
        extra = {"produced_by": {"backend": self.name, **produced_by}}
        return self.chat.turn(output_ids, prompt_ids, messages, tools, usage, extra)
