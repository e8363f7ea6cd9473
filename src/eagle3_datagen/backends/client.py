"""The HTTP session both API backends use: one aiohttp session, retried POSTs.

At 2,000 requests in flight the client's own CPU per request decides the rate (BENCHMARKS.md): bodies
are encoded and parsed with orjson, and a request's first attempt runs without tenacity's machinery,
which only a failed attempt enters.
"""

from __future__ import annotations

from collections.abc import Callable

import aiohttp
import orjson

from eagle3_datagen.backends.base import RetryableError, ServerGone
from eagle3_datagen.backends.http import RetryPolicy, classify, parse_retry_after

JSON = {"Content-Type": "application/json"}  # every POST's body (a session header: no merge per request)


class JsonClient:
    def __init__(
        self,
        base_url: str,
        connections: int,
        timeout_s: float,
        retry: RetryPolicy,
        headers=None,
        server_alive: Callable[[], bool] | None = None,
    ):
        """`server_alive`: for a server this job started, whether it still runs; a request that fails
        to connect once it does not raises ServerGone instead of being retried."""
        self.base_url = base_url.rstrip("/")
        self.server_alive = server_alive
        self.connections = connections
        self.timeout_s = timeout_s
        self.retry = retry
        self._headers = headers or {}
        self.session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.connections),
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            headers={**JSON, **self._headers},
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def get(self, path: str) -> tuple[int, object]:
        async with self.session.get(self.base_url + path) as resp:
            return resp.status, await resp.json(content_type=None)

    async def _attempt(self, path: str, payload: bytes, check) -> dict:
        try:
            async with self.session.post(self.base_url + path, data=payload) as resp:
                data = await resp.read()
                try:
                    body = orjson.loads(data)
                except orjson.JSONDecodeError:
                    body = {"error": {"message": data.decode(errors="replace")[:300]}}
                if resp.status != 200:
                    raise classify(resp.status, body, parse_retry_after(resp.headers.get("Retry-After")))
        except (TimeoutError, aiohttp.ClientError) as e:
            if self.server_alive is not None and not self.server_alive():
                raise ServerGone(f"the server at {self.base_url} is gone ({type(e).__name__}: {e})") from None
            raise RetryableError(f"{type(e).__name__}: {e}") from None
        check(body)
        return body

    async def post(self, path: str, payload: dict, check=lambda body: None) -> tuple[dict, int]:
        """POST with retries; returns the body and the number of attempts it took."""
        data = orjson.dumps(payload)
        try:
            return await self._attempt(path, data, check), 1
        except RetryableError as error:
            first: RetryableError | None = error
        async for attempt in self.retry.retrying():
            with attempt:
                if first is not None:  # the first attempt, made above, failed: tenacity takes it from here
                    error, first = first, None
                    raise error
                body = await self._attempt(path, data, check)
            if not attempt.retry_state.outcome.failed:
                return body, attempt.retry_state.attempt_number
        raise AssertionError("unreachable: tenacity reraises the last error")
