#!/usr/bin/env python
"""Throughput of the OpenRouter client at high concurrency, against the loopback server.

The loopback runs in its own process and answers each request after --latency seconds, so
the ideal rate is concurrency / latency; the ratio to it is the client's overhead (event
loop, JSON, journal writes, retries). A second run injects 429s with Retry-After into 10% of
the prompts.

Usage: python bench/api_concurrency.py [--prompts 20000] [--concurrency 2000 200] [--latency 0.5]
Run from the repository root with the project's venv on PATH.
"""

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from eagle3_datagen.backends.openrouter import OpenRouterBackend
from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.formats.files import write_jsonl_zst
from eagle3_datagen.stages.responses.journaled import Budgets, run_journaled_responses

KEY_ENV = "E3DG_BENCH_KEY"


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


def one_run(n: int, concurrency: int, latency: float, faults: dict) -> dict:
    port = free_port()
    server = start_loopback(port, {"latency_s": latency, **faults})
    try:
        with tempfile.TemporaryDirectory() as tmp:
            prompts = Path(tmp) / "prompts.jsonl.zst"
            rows = [
                {"id": f"{i:06d}", "source": "bench", "messages": [{"role": "user", "content": f"Q{i}"}]}
                for i in range(n)
            ]
            write_jsonl_zst(prompts, rows)
            backend = OpenRouterBackend(
                fill_defaults({"max_new_tokens": 64}, "inference.sampling"),
                fill_defaults(
                    {
                        "base_url": f"http://127.0.0.1:{port}",
                        "model": "m",
                        "api_key_env": KEY_ENV,
                        "concurrency": concurrency,
                        "retry": {"initial_backoff": 0.2, "max_backoff": 2},
                    },
                    "inference.openrouter",
                ),
            )
            cpu0 = time.process_time()
            start = time.perf_counter()
            stats = run_journaled_responses(
                prompts,
                Path(tmp) / "out.jsonl.zst",
                Path(tmp) / "stats.json",
                backend,
                Budgets(),
                progress_interval=1e9,
            )
            seconds = time.perf_counter() - start
            cpu = time.process_time() - cpu0
    finally:
        server.terminate()
        server.wait()
    ideal = n / concurrency * latency
    return {
        "seconds": seconds,
        "ideal": ideal,
        "ok": stats["status"].get("ok", 0),
        "cpu_ms_per_request": 1000 * cpu / n,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=20000)
    p.add_argument("--concurrency", type=int, nargs="+", default=[2000, 200])
    p.add_argument("--latency", type=float, default=0.5)
    args = p.parse_args()
    os.environ[KEY_ENV] = "bench-key"
    print("| concurrency | faults | prompts ok | seconds | ideal seconds | ideal / actual | client CPU ms/request |")
    print("|---|---|---|---|---|---|---|")
    runs = [(c, {}) for c in args.concurrency]
    runs.append((args.concurrency[0], {"every": 10, "sequence": [429], "retry_after": 1}))
    for concurrency, faults in runs:
        r = one_run(args.prompts, concurrency, args.latency, faults)
        label = "10% 429, Retry-After 1 s" if faults else "none"
        print(
            f"| {concurrency} | {label} | {r['ok']} | {r['seconds']:.1f} | {r['ideal']:.1f} | "
            f"{r['ideal'] / r['seconds']:.2f} | {r['cpu_ms_per_request']:.2f} |"
        )
    print(f"\npeak RSS of the client process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
