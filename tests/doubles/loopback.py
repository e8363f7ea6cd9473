"""A loopback stand-in for SGLang's and OpenRouter's HTTP APIs, with fault injection.

Tests and benchmarks run the real backends against it: `/health`, `/model_info` and `/generate` answer as
SGLang does (exact `output_ids` from the model's tokenizer, the matched end-of-turn token included),
`/chat/completions` as OpenRouter does (text, reasoning, usage with cost, provider). Faults follow a plan: for
the requests whose content hashes into 1/`every` of them (or into the first `rate` of them: an outage of that
share), attempt k gets `sequence[k-1]` (an HTTP status, `"200-error"` or `"200-empty"`), later attempts
succeed. `credits` makes every completion after that many answer 402; `require` answers 400 ("invalid
temperature: ...") to a chat request whose parameter differs from the value it names (a provider that takes
only temperature 1); a user turn holding `[refuse]` gets a refusal as a content filter gives it. `answers`
answers a user turn holding one of its keys with a real provider error (`PROVIDER_ERRORS`, from
tests/fixtures/provider_errors.yaml: its status, Retry-After and body, or its stream) on every attempt,
`answers_once` on the first attempt only (`"cut"`: a stream that stops mid-answer). A request with `stream:
true` is answered as OpenRouter streams (SSE: a keep-alive comment, the deltas `chunk_delay_s` apart, the
finish, a last chunk with the usage, `[DONE]`). The server counts requests in flight (`max_in_flight`, in
/stats) and the answers given per request content (`completed`), and lists `/generate`'s prompts in the order
answered (`generated`); `slow` gives the prompts that hold a substring a latency of their own, cut short once
the file `release` names exists. A tool script makes the stand-in model call tools: after a user turn that
contains a script entry's `trigger`, `/generate` emits that call in the template's own tool-call markers and
`/chat/completions` returns it in `message.tool_calls`; once a call follows the trigger it answers in text.
`/generate` closes a think block its prompt opens. Runnable as a server (`python -m tests.doubles.loopback
--help`), also in the place of `sglang.launch_server`; started with `--speculative-algorithm EAGLE3` (and
`--speculative-num-steps N`), `/generate` also reports the figures SGLang's EAGLE3 does (`spec_verify_ct`: a
verify step per N + 1 tokens; `spec_accept_length`), so that a client of EAGLE3 serving runs where SGLang's
EAGLE3 cannot (no GPU).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from aiohttp import web

from eagle3_datagen.chat.template import load_tokenizer
from eagle3_datagen.chat.tool_calls import derive_markers

# A user turn holding this is refused as a provider's content filter refuses (`message.refusal`,
# `finish_reason: content_filter`).
REFUSED = "[refuse]"
# Real error bodies of OpenRouter and the providers behind it, by name, each with its source.
PROVIDER_ERRORS = yaml.safe_load((Path(__file__).parents[1] / "fixtures/provider_errors.yaml").read_text())
CUT = "cut"  # an `answers_once` value: the stream stops after its first deltas, no error, no finish


@dataclass
class FaultPlan:
    every: int = 0  # 0: no faults
    sequence: list = field(default_factory=list)
    retry_after: float | None = None
    latency_s: float = 0.0
    slow: dict = field(default_factory=dict)  # prompt substring -> seconds its /generate answer takes instead
    release: str | None = None  # a file whose creation ends the `slow` answers' wait early
    credits: int | None = None  # completions before 402
    reject: list = field(default_factory=list)  # substrings of user content answered 400
    rate: float = 0.0  # the share of requests (by content) that get `sequence`'s faults
    require: dict = field(default_factory=dict)  # chat parameter -> the only value taken (else 400)
    answers: dict = field(default_factory=dict)  # user content substring -> a PROVIDER_ERRORS name, every attempt
    answers_once: dict = field(default_factory=dict)  # the same, first attempt only (or CUT)
    chunk_delay_s: float = 0.0  # between two streamed chunks


@dataclass(frozen=True)
class ScriptedCall:
    trigger: str  # a user turn containing this is answered with the call
    name: str
    arguments: str  # JSON


class Loopback:
    def __init__(
        self,
        model_path: str,
        tokenizer=None,
        api_key: str | None = None,
        faults: FaultPlan | None = None,
        tool_script: list[ScriptedCall] = (),
        speculative_steps: int | None = None,
        prices: dict | None = None,
        answer: Callable[[list[dict]], str] | None = None,
    ):
        """`prices`: USD per million prompt and completion tokens an answer costs (None: $0.001 each).
        `answer`: the text `/chat/completions` answers a conversation's messages with (a model's own sampled
        answer, as a provider serving that model returns it), in place of "Reply to: ..."."""
        self.model_path = model_path
        self.speculative_steps = speculative_steps
        self.tokenizer = tokenizer
        self.api_key = api_key
        self.faults = faults or FaultPlan()
        self.tool_script = list(tool_script)
        self.markers = derive_markers(tokenizer) if tokenizer is not None and self.tool_script else None
        self.attempts: Counter = Counter()  # request key -> attempts seen
        self.completed: Counter = Counter()  # request key -> successful answers
        self.status_counts: Counter = Counter()
        self.last_chat_request: dict | None = None
        self.generate_prompts: list[str] = []  # each /generate prompt, decoded
        self.in_flight = 0
        self.max_in_flight = 0
        self.prices = prices
        self.answer = answer
        self.billed = 0.0  # what every answer cost, sent to a client still there or not

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/model_info", self.model_info)
        app.router.add_get("/stats", self.stats)
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/chat/completions", self.chat)
        return app

    async def health(self, _request) -> web.Response:
        return web.json_response({})

    async def model_info(self, _request) -> web.Response:
        return web.json_response({"model_path": self.model_path, "is_generation": True})

    async def stats(self, _request) -> web.Response:
        return web.json_response(
            {
                "attempts": dict(self.attempts),
                "completed": dict(self.completed),
                "status": dict(self.status_counts),
                "max_in_flight": self.max_in_flight,
                "generated": self.generate_prompts,  # /generate's prompts, in the order they were answered
            }
        )

    def _released(self) -> bool:
        return self.faults.release is not None and os.path.exists(self.faults.release)

    def _fault(self, key: str) -> object | None:
        attempt = self.attempts[key]
        plan = self.faults
        faulted = (plan.every and int(key[:8], 16) % plan.every == 0) or int(key[:8], 16) < plan.rate * 16**8
        if faulted and attempt <= len(plan.sequence):
            return plan.sequence[attempt - 1]
        if plan.credits is not None and sum(self.completed.values()) >= plan.credits:
            return 402
        return None

    def _error(self, fault: object) -> web.Response:
        self.status_counts[str(fault)] += 1
        if fault == "200-error":
            return web.json_response({"error": {"code": 502, "message": "provider error during generation"}})
        if fault == "200-empty":
            return web.json_response({"choices": [], "usage": {}})
        # 429 and 503 always carry Retry-After; a 402 only when the plan gives one.
        headers = {}
        if fault in (429, 503) or (fault == 402 and self.faults.retry_after is not None):
            headers = {"Retry-After": str(self.faults.retry_after or 0)}
        body = {"error": {"code": fault, "message": f"injected {fault}"}}
        return web.json_response(body, status=int(fault), headers=headers)

    async def _admit(self, key: str, latency_s: float | None = None) -> web.Response | None:
        self.attempts[key] += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if latency_s is not None:
                deadline = asyncio.get_running_loop().time() + latency_s
                while asyncio.get_running_loop().time() < deadline and not self._released():
                    await asyncio.sleep(0.05)
            elif self.faults.latency_s:
                await asyncio.sleep(self.faults.latency_s)
        finally:
            self.in_flight -= 1
        fault = self._fault(key)
        return None if fault is None else self._error(fault)

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        ids = body["input_ids"]
        key = hashlib.sha256(json.dumps(ids).encode()).hexdigest()
        prompt = self.tokenizer.decode(ids, skip_special_tokens=False)
        error = await self._admit(key, next((s for text, s in self.faults.slow.items() if text in prompt), None))
        if error is not None:
            return error
        params = body.get("sampling_params") or {}
        eot = (params.get("stop_token_ids") or [0])[0]
        self.generate_prompts.append(prompt)
        answer = "Considering it.</think>" if prompt.endswith("<think>") else ""
        call = self._scripted_call(prompt, lambda trigger_at: self.markers.section_begin in prompt[trigger_at:])
        if call is None:
            answer += f"Answer {sum(ids) % 997} of {len(ids)}."
        else:
            answer += self.markers.render([(call.name, call.arguments)], prompt.count(self.markers.call_begin))
        output = [*self.tokenizer(answer, add_special_tokens=False)["input_ids"], eot]
        limit = params.get("max_new_tokens", 128)
        finish = {"type": "stop", "matched": eot} if len(output) <= limit else {"type": "length", "length": limit}
        output = output[:limit]
        self.completed[key] += 1
        self.status_counts["200"] += 1
        meta = {"finish_reason": finish, "prompt_tokens": len(ids), "completion_tokens": len(output)}
        if self.speculative_steps:
            verify = -(-len(output) // (self.speculative_steps + 1))
            meta |= {"spec_verify_ct": verify, "spec_accept_length": len(output) / verify}
        return web.json_response({"text": "", "output_ids": output, "meta_info": meta})

    def _scripted_call(self, text: str, called_since) -> ScriptedCall | None:
        """The script entry whose trigger occurs last in `text`, unless `called_since(its position)`."""
        found = [(text.rfind(c.trigger), c) for c in self.tool_script if c.trigger in text]
        if not found:
            return None
        at, call = max(found, key=lambda pair: pair[0])
        return None if called_since(at) else call

    async def chat(self, request: web.Request) -> web.Response:
        if self.api_key is not None and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            self.status_counts["401"] += 1
            return web.json_response({"error": {"code": 401, "message": "No auth credentials found"}}, status=401)
        body = await request.json()
        self.last_chat_request = body
        key = hashlib.sha256(json.dumps(body["messages"]).encode()).hexdigest()
        last_user = next(m["content"] for m in reversed(body["messages"]) if m["role"] == "user")
        if any(word in last_user for word in self.faults.reject):
            self.attempts[key] += 1
            self.status_counts["400"] += 1
            return web.json_response({"error": {"code": 400, "message": "invalid request"}}, status=400)
        for name, value in self.faults.require.items():
            if body.get(name) != value:
                self.attempts[key] += 1
                self.status_counts["400"] += 1
                message = f"invalid {name}: only {value} is allowed for this model"
                return web.json_response({"error": {"code": 400, "message": message}}, status=400)
        fixture = self._provider_answer(key, last_user)
        if fixture is not None:
            return await self._answer_with(request, body, fixture)
        error = await self._admit(key)
        if error is not None:
            return error
        content = self.answer(body["messages"]) if self.answer else f"Reply to: {last_user[:40]}"
        completion = len(content.split()) + 4
        finish = "length" if completion > body.get("max_tokens", 1 << 30) else "stop"
        call = None
        if body.get("tools"):
            after_user = len(body["messages"]) - [m["role"] for m in reversed(body["messages"])].index("user")
            call = self._scripted_call(last_user, lambda _: len(body["messages"]) > after_user)
        self.completed[key] += 1
        self.status_counts["200"] += 1
        prompt = sum(len((m.get("content") or "").split()) for m in body["messages"])
        cost = (prompt * self.prices["prompt"] + completion * self.prices["completion"]) / 1e6 if self.prices else 0.001
        self.billed += cost
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "completion_tokens_details": {"reasoning_tokens": 4},
            "cost": cost,
        }
        reasoning = "Considering it." if (body.get("reasoning") or {}).get("enabled") else None
        choice = {"message": {"role": "assistant", "content": content, "reasoning": reasoning}}
        if REFUSED in last_user:  # a provider's content filter: no content, its refusal, finish_reason as sent
            choice["message"].update(content=None, refusal="I can't help with that.")
            finish = "content_filter"
        if call is not None:
            call_id = f"call_{hashlib.sha256(key.encode()).hexdigest()[:8]}"  # an OpenAI-style id, not Kimi's
            function = {"name": call.name, "arguments": call.arguments}
            choice["message"].update(
                content=None, tool_calls=[{"id": call_id, "type": "function", "function": function}]
            )
            finish = "tool_calls"
        choice["finish_reason"] = finish
        if body.get("stream"):
            return await self._stream(request, body["model"], _deltas(choice["message"]), finish, usage)
        return web.json_response({"provider": "Loopback", "model": body["model"], "choices": [choice], "usage": usage})

    def _provider_answer(self, key: str, last_user: str) -> str | None:
        """The PROVIDER_ERRORS name (or CUT) this request is answered with, per `answers` and `answers_once`."""
        for plan, every in ((self.faults.answers, True), (self.faults.answers_once, False)):
            for trigger, name in plan.items():
                if trigger in last_user and (every or self.attempts[key] == 0):
                    self.attempts[key] += 1
                    self.status_counts[name] += 1
                    return name
        return None

    async def _answer_with(self, request: web.Request, body: dict, name: str) -> web.StreamResponse:
        if name == CUT:
            message = {"role": "assistant", "content": "An answer that stops in the mid"}
            return await self._stream(request, body["model"], _deltas(message), None, None)
        entry = PROVIDER_ERRORS[name]
        if "stream" in entry:
            if body.get("stream"):
                return await self._sse(request, entry["stream"])
            last = entry["stream"][-1]  # not streamed: the error in the 200's choice
            choice = {"message": {"role": "assistant", "content": ""}, "finish_reason": "error", "error": last["error"]}
            return web.json_response({"choices": [choice]})
        headers = {"Retry-After": entry["retry_after"]} if "retry_after" in entry else {}
        return web.json_response(entry["body"], status=entry["status"], headers=headers)

    async def _stream(self, request, model: str, deltas: list[dict], finish: str | None, usage: dict | None):
        """An answer as OpenRouter streams it: `deltas`, then the finish (None: none, a cut stream), then
        the usage."""
        head = {"id": "gen-loopback", "object": "chat.completion.chunk", "provider": "Loopback", "model": model}
        chunks = [{**head, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
        if finish is not None:
            chunks.append({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
            chunks.append({**head, "choices": [], "usage": usage})
        return await self._sse(request, chunks, done=finish is not None)

    async def _sse(self, request: web.Request, chunks: list[dict], done: bool = False) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b": OPENROUTER PROCESSING\n\n")
        for chunk in chunks:
            if self.faults.chunk_delay_s:
                await asyncio.sleep(self.faults.chunk_delay_s)
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if done:
            await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _deltas(message: dict) -> list[dict]:
    """A message as the deltas a stream sends: role, reasoning, the content in word pieces, a refusal, each
    tool call with its arguments in two pieces."""
    deltas = [{"role": "assistant", "content": ""}]
    if message.get("reasoning"):
        deltas.append({"reasoning": message["reasoning"]})
    words = (message.get("content") or "").split(" ")
    deltas += [{"content": word if i == 0 else f" {word}"} for i, word in enumerate(words) if word]
    if message.get("refusal"):
        deltas.append({"refusal": message["refusal"]})
    for index, call in enumerate(message.get("tool_calls") or ()):
        arguments = call["function"]["arguments"]
        half = len(arguments) // 2
        first = {"index": index, "id": call["id"], "type": "function"}
        deltas.append(
            {"tool_calls": [{**first, "function": {"name": call["function"]["name"], "arguments": arguments[:half]}}]}
        )
        deltas.append({"tool_calls": [{"index": index, "function": {"arguments": arguments[half:]}}]})
    return deltas


@contextlib.contextmanager
def serve_in_thread(loopback: Loopback) -> Iterator[str]:
    """Serve `loopback` on a free local port from a background thread; yields its base URL."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(loopback.app(), access_log=None)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()


def main() -> None:
    p = argparse.ArgumentParser(description="Serve the loopback stand-in (SGLang and OpenRouter APIs).")
    p.add_argument("--model-path", required=True, help="reported by /model_info; its tokenizer answers /generate")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--faults", type=json.loads, default={}, help="a FaultPlan as JSON")
    p.add_argument("--api-key-env", help="require the key held in this environment variable")
    p.add_argument("--speculative-algorithm", help="EAGLE3: report SGLang's speculative decoding figures")
    p.add_argument("--speculative-num-steps", type=int, default=3)
    args, _ignored = p.parse_known_args()  # in place of sglang.launch_server: ignore its other flags
    has_tokenizer = (Path(args.model_path) / "tokenizer_config.json").exists()
    loopback = Loopback(
        args.model_path,
        load_tokenizer(args.model_path) if has_tokenizer else None,
        os.environ.get(args.api_key_env) if args.api_key_env else None,
        FaultPlan(**args.faults),
        speculative_steps=args.speculative_num_steps if args.speculative_algorithm == "EAGLE3" else None,
    )
    web.run_app(loopback.app(), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
