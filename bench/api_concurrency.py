#!/usr/bin/env python
"""Throughput of the OpenRouter client at high concurrency, against the loopback server, beside a plain
aiohttp loop in the same run.

The loopback runs in its own process and answers each request after --latency seconds, so the ideal
rate is concurrency / latency. Each setting runs the project's client (the responses driver with its
journal, retries, progress and the run-wide ledger, as a shard job runs it) and a plain aiohttp loop
(one session, a semaphore, the same requests and prompts, the answers written as JSON lines at the
end) against the same server process, alternately, --repeats times each; the medians are reported,
with project/naive (the robust figure on a shared machine). A last run injects 429s with Retry-After
into 10% of the prompts (the project's client alone: the plain loop does not retry).

Usage: python bench/api_concurrency.py [--prompts 20000] [--concurrency 2000 200] [--latency 0.5] [--repeats 3]
Run from the repository root with the project's venv on PATH.
"""

import argparse
import asyncio
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import orjson

from eagle3_datagen.backends.openrouter import OpenRouterBackend
from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.formats.files import write_jsonl_zst
from eagle3_datagen.stages.responses.journaled import Budgets, run_journaled_responses

KEY_ENV = "E3DG_BENCH_KEY"
MODEL = "m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_loopback(port: int, faults: dict) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "tests.doubles.loopback",
        "--model-path",
        "bench",
        "--port",
        str(port),
        "--faults",
        json.dumps(faults),
        "--api-key-env",
        KEY_ENV,
    ]
    # The loopback is a test double (tests/doubles): run it as a module of the repository.
    server = subprocess.Popen(command, stderr=subprocess.DEVNULL, cwd=Path(__file__).resolve().parents[1])
    for _ in range(200):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return server
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("loopback did not start")


def prompt_rows(n: int, tag: str) -> list[dict]:
    """`n` one-turn prompts; `tag` keeps each run's requests distinct (the loopback counts by content)."""
    return [
        {"id": f"{i:06d}", "source": "bench", "messages": [{"role": "user", "content": f"Q{i} {tag}"}]}
        for i in range(n)
    ]


def project_run(url: str, rows: list[dict], concurrency: int) -> tuple[float, float, int]:
    """The project's client as a shard job runs it: (seconds, client CPU seconds, prompts ok)."""
    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "prompts.jsonl.zst"
        write_jsonl_zst(prompts, rows)
        backend = OpenRouterBackend(
            fill_defaults({"max_new_tokens": 64}, "inference.sampling"),
            fill_defaults(
                {
                    "base_url": url,
                    "model": MODEL,
                    "api_key_env": KEY_ENV,
                    "concurrency": concurrency,
                    "retry": {"initial_backoff": 0.2, "max_backoff": 2},
                },
                "inference.openrouter",
            ),
        )
        cpu0, start = time.process_time(), time.perf_counter()
        stats = run_journaled_responses(
            prompts,
            Path(tmp) / "results/p/responses/00000.jsonl.zst",
            Path(tmp) / "results/p/responses/00000.stats.json",
            backend,
            Budgets(),
            progress_interval=1e9,
        )
        return time.perf_counter() - start, time.process_time() - cpu0, stats["status"].get("ok", 0)


async def _naive(url: str, rows: list[dict], concurrency: int, out: Path) -> int:
    slots = asyncio.Semaphore(concurrency)
    headers = {"Authorization": f"Bearer {os.environ[KEY_ENV]}"}
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:

        async def ask(row: dict) -> dict:
            payload = {"model": MODEL, "messages": row["messages"], "max_tokens": 64, "temperature": 0.0}
            async with slots, session.post(f"{url}/chat/completions", json=payload) as resp:
                return await resp.json()

        answers = await asyncio.gather(*(ask(row) for row in rows))
    out.write_bytes(b"".join(orjson.dumps(answer) + b"\n" for answer in answers))
    return sum(bool(answer.get("choices")) for answer in answers)


def naive_run(url: str, rows: list[dict], concurrency: int) -> tuple[float, float, int]:
    """A plain aiohttp loop: (seconds, client CPU seconds, prompts ok)."""
    with tempfile.TemporaryDirectory() as tmp:
        cpu0, start = time.process_time(), time.perf_counter()
        ok = asyncio.run(_naive(url, rows, concurrency, Path(tmp) / "answers.jsonl"))
        return time.perf_counter() - start, time.process_time() - cpu0, ok


def measure(n: int, concurrency: int, latency: float, faults: dict, repeats: int) -> dict:
    port = free_port()
    server = start_loopback(port, {"latency_s": latency, **faults})
    url = f"http://127.0.0.1:{port}"
    runs = {"project": [], "naive": []}
    try:
        for repeat in range(repeats):
            for name, run in (("naive", naive_run), ("project", project_run)):
                if name == "naive" and faults:
                    continue  # the plain loop does not retry
                runs[name].append(run(url, prompt_rows(n, f"{name}{repeat}"), concurrency))
    finally:
        server.terminate()
        server.wait()
    result = {"ideal": n / concurrency * latency}
    for name, measured in runs.items():
        if measured:
            result[name] = {
                "seconds": statistics.median(m[0] for m in measured),
                "cpu_ms": 1000 * statistics.median(m[1] for m in measured) / n,
                "ok": min(m[2] for m in measured),
            }
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=20000)
    p.add_argument("--concurrency", type=int, nargs="+", default=[2000, 200])
    p.add_argument("--latency", type=float, default=0.5)
    p.add_argument("--repeats", type=int, default=3, help="runs of each client per setting (medians reported)")
    args = p.parse_args()
    os.environ[KEY_ENV] = "bench-key"
    print(
        "| concurrency | faults | prompts ok | project s | naive s | ideal s | project / ideal | naive / ideal "
        "| project / naive | client CPU ms/request (project, naive) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    runs = [(c, {}) for c in args.concurrency]
    runs.append((args.concurrency[0], {"every": 10, "sequence": [429], "retry_after": 1}))
    for concurrency, faults in runs:
        r = measure(args.prompts, concurrency, args.latency, faults, 1 if faults else args.repeats)
        label = "10% 429, Retry-After 1 s" if faults else "none"
        project, naive = r["project"], r.get("naive")
        cells = [
            str(concurrency),
            label,
            str(project["ok"]),
            f"{project['seconds']:.1f}",
            f"{naive['seconds']:.1f}" if naive else "-",
            f"{r['ideal']:.1f}",
            f"{r['ideal'] / project['seconds']:.2f}",
            f"{r['ideal'] / naive['seconds']:.2f}" if naive else "-",
            f"{naive['seconds'] / project['seconds']:.2f}" if naive else "-",
            f"{project['cpu_ms']:.2f}, {naive['cpu_ms']:.2f}" if naive else f"{project['cpu_ms']:.2f}",
        ]
        print("| " + " | ".join(cells) + " |", flush=True)
    print(f"\npeak RSS of the client process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
