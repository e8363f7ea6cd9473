"""The HTTP session both API backends use: one aiohttp session, retried POSTs, plain or streamed.

At 2,000 requests in flight the client's own CPU per request decides the rate (BENCHMARKS.md): bodies
are encoded and parsed with orjson, and a request's first attempt runs without tenacity's machinery,
which only a failed attempt enters. A plain POST may take `timeout_s` in all; a streamed one
(`post_stream`, server-sent events) has no total, only `idle_timeout_s` between two reads, so a long
answer that keeps arriving is never cut. What failed attempts were billed (`Spend`: a 200 carrying an
error, a stream cut or ended by an error) is summed and returned with the answer, or carried by the
error that ends the request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import aiohttp
import orjson

from eagle3_datagen.backends.base import RequestFailed, RetryableError, ServerError, ServerGone
from eagle3_datagen.backends.http import RetryPolicy, classify, parse_retry_after
from eagle3_datagen.backends.stream import ChatStream
from eagle3_datagen.formats.spend import Spend

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
        idle_timeout_s: float | None = None,
    ):
        """`server_alive`: for a server this job started, whether it still runs; a request that fails
        to connect once it does not raises ServerGone instead of being retried. `idle_timeout_s`: the
        longest wait for a streamed answer's next bytes."""
        self.base_url = base_url.rstrip("/")
        self.server_alive = server_alive
        self.connections = connections
        self.timeout_s = timeout_s
        self.retry = retry
        self.idle_timeout = aiohttp.ClientTimeout(total=None, sock_connect=idle_timeout_s, sock_read=idle_timeout_s)
        self._headers = headers or {}
        self.session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.connections),
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            headers={**JSON, **self._headers},
            read_bufsize=1 << 20,  # one SSE line is one chunk: a tool call's arguments may be long
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def get(self, path: str) -> tuple[int, object]:
        """GET once (the entry checks); a server this job started that is gone raises ServerGone."""
        try:
            async with self.session.get(self.base_url + path) as resp:
                return resp.status, await resp.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError) as e:
            error = self._unreachable(e)
            if isinstance(error, ServerGone):
                raise error from None
            raise ServerError(f"GET {self.base_url}{path} failed: {error}") from None

    async def _attempt(self, path: str, payload: bytes, check) -> dict:
        try:
            async with self.session.post(self.base_url + path, data=payload) as resp:
                data = await resp.read()
                body = _parsed(data)
                if resp.status != 200:
                    raise classify(resp.status, body, parse_retry_after(resp.headers.get("Retry-After")))
        except (TimeoutError, aiohttp.ClientError) as e:
            raise self._unreachable(e) from None
        check(body)
        return body

    async def _stream_attempt(self, path: str, payload: bytes, new_stream: Callable[[], ChatStream]) -> dict:
        stream = new_stream()
        try:
            async with self.session.post(self.base_url + path, data=payload, timeout=self.idle_timeout) as resp:
                if resp.status != 200:
                    retry_after = parse_retry_after(resp.headers.get("Retry-After"))
                    raise classify(resp.status, _parsed(await resp.read()), retry_after)
                if resp.content_type == "application/json":  # a 200 that is no stream: an error, as one chunk
                    stream.add(_parsed(await resp.read()))
                    return stream.body()
                async for line in resp.content:
                    if not line.startswith(b"data:"):  # a keep-alive comment, a blank line between events
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    stream.add(orjson.loads(data))
            return stream.body()
        except (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError) as e:
            error = self._unreachable(e)
            error.lost = stream.lost()
            raise error from None
        except (RetryableError, RequestFailed) as e:
            e.lost = stream.lost()
            raise

    def _unreachable(self, e: Exception) -> Exception:
        if self.server_alive is not None and not self.server_alive():
            return ServerGone(f"the server at {self.base_url} is gone ({type(e).__name__}: {e})")
        return RetryableError(f"{type(e).__name__}: {e}")

    async def post(self, path: str, payload: dict, check=lambda body: None) -> tuple[dict, int, Spend]:
        """POST with retries; returns the body, the number of attempts it took and what the failed ones
        were billed."""
        data = orjson.dumps(payload)
        return await self._retried(lambda: self._attempt(path, data, check))

    async def post_stream(self, path: str, payload: dict, new_stream: Callable[[], ChatStream]):
        """`post` of a streamed answer, each attempt assembled by a fresh `new_stream()`."""
        data = orjson.dumps(payload)
        return await self._retried(lambda: self._stream_attempt(path, data, new_stream))

    async def _retried(self, attempt: Callable[[], Awaitable[dict]]) -> tuple[dict, int, Spend]:
        lost = Spend()

        async def counted() -> dict:
            nonlocal lost
            try:
                return await attempt()
            except (RetryableError, RequestFailed) as error:
                lost = error.lost = lost + error.lost  # the error that ends the request carries the sum
                raise

        try:
            return await counted(), 1, lost
        except RetryableError as error:
            first: RetryableError | None = error
        async for tried in self.retry.retrying():
            with tried:
                if first is not None:  # the first attempt, made above, failed: tenacity takes it from here
                    error, first = first, None
                    raise error
                body = await counted()
            if not tried.retry_state.outcome.failed:
                return body, tried.retry_state.attempt_number, lost
        raise AssertionError("unreachable: tenacity reraises the last error")


def _parsed(data: bytes) -> object:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return {"error": {"message": data.decode(errors="replace")[:300]}}
