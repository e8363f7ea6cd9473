#!/usr/bin/env python
"""The node's SGLang server across shard boundaries, fed by one shard job at a time and by
`inference.sglang.launch.shard_jobs` at once (issue 45), with real SGLang 0.5.23 on the CPU.

A tiny random Qwen3 (Qwen3's real tokenizer and chat template) is served by `sglang.launch_server`,
started as the workflow starts it: the first shard job starts the node's shared server
(`backends.service`) and every job is its client (`stages.responses.job.run_response_job`, each job a
process of its own, as Snakemake runs them). The shards are run twice on the one server, each time
into a fresh results folder: with 1 job at a time (before) and with `--shard-jobs` at once, a job
started as soon as one ends (what Snakemake does with the node's `gpu` pool dealt out in shares).

Long-tailed answers: the model is random, so each request's `max_new_tokens` is drawn from a Pareto
distribution (`--alpha`, from `--min-tokens`, at most `--max-tokens`; seeded by the prompt's token
IDs) and sent with `ignore_eos`: a bench-only stand-in for thinking answers' lengths, patched into
the jobs' payloads. The server runs at most `--concurrency` requests (`--max-running-requests`, the
tiers' sum: every prompt here is in the short tier) and logs each decode step's `#running-req`
(`--decode-log-interval 1`). From its log: per second, whether any request was running (busy) and
the running requests over the concurrency (occupancy), over the window from the first shard's first
decode step to the end of the second-to-last shard job (every shard boundary; the last shard's own
tail, which no next shard can fill, is left out); and the same around each boundary
(`--boundary-s` either side of a shard job's end).

Usage (from the repository root, after `make sglang-env`):
  .venv-sglang/bin/python bench/fed_server_cpu.py --shards 6 --prompts 16
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# `[2026-12-07 05:40:01] Decode batch, #running-req: 8, ...`: SGLang logs at second resolution.
DECODE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)[^\]]*\] Decode batch.*?#running-req: (\d+)")


def drawn_length(prompt_ids: list[int], alpha: float, low: int, high: int) -> int:
    """A Pareto length from `low` (tail index `alpha`), at most `high`, fixed by the prompt."""
    u = int.from_bytes(hashlib.sha256(json.dumps(prompt_ids).encode()).digest()[:8], "big") / 2**64
    return min(high, int(low * (1.0 - u) ** (-1.0 / alpha)))


def run_job(job: dict) -> None:
    """One shard job: the workflow's responses job, its payloads given drawn lengths and ignore_eos."""
    from eagle3_datagen.backends.sglang.generate import SGLangBackend
    from eagle3_datagen.stages.responses.job import run_response_job

    payload = SGLangBackend._payload

    def long_tailed(self, prompt_ids, tier):
        sent = payload(self, prompt_ids, tier)
        length = drawn_length(prompt_ids, *job["lengths"])
        sent["sampling_params"].update(max_new_tokens=length, ignore_eos=True)
        return sent

    SGLangBackend._payload = long_tailed
    run_response_job([tuple(job["shard"])], job["settings"], job["server_log"])


def job_settings(model: Path, url: str, concurrency: int, max_tokens: int) -> dict:
    from eagle3_datagen.config_schema import fill_defaults
    from tests.helpers.sglang_cpu import CPU_LAUNCH_ARGS

    launch = {
        "command": [sys.executable, "-m", "sglang.launch_server"],
        "args": [*CPU_LAUNCH_ARGS, "--max-running-requests", str(concurrency), "--decode-log-interval", "1"]
        + ["--max-total-tokens", str(concurrency * (max_tokens + 64))],  # every running answer's cache
        "health_timeout": 900,
        "idle_timeout": 600,  # the server stays up between the two runs
    }
    sglang = {"url": url, "launch": launch, "tiers": {"short": {"concurrency": concurrency}, "long": {}}}
    # The long tier's slots: its own concurrency beside the short tier's (1: no prompt here is long).
    sglang["tiers"]["long"]["concurrency"] = 1
    return {
        "backend": "sglang",
        "sampling": fill_defaults({"temperature": 0.0, "max_new_tokens": 4096}, "inference.sampling"),
        "sglang": fill_defaults(sglang, "inference.sglang"),
        "model": fill_defaults({"path": str(model)}, "model"),
        "gpus": 0,
        "handover": fill_defaults({}, "resources.handover"),
        "max_failed_rate": 0.0,
    }


def write_model(path: Path) -> Path:
    import torch

    from eagle3_datagen.targets.demo import qwen3_tokenizer
    from tests.helpers import tiny_qwen3

    tokenizer = qwen3_tokenizer()
    torch.manual_seed(2)
    tiny_qwen3(len(tokenizer), num_layers=2).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_shards(folder: Path, shards: int, prompts: int) -> list[Path]:
    from eagle3_datagen.formats.files import write_jsonl_zst

    paths = []
    for shard in range(shards):
        path = folder / f"prompts/{shard:05d}.jsonl.zst"
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = [
            {
                "id": f"s{shard}-p{i}",
                "source": "bench",
                "messages": [{"role": "user", "content": f"Question {shard}.{i}"}],
            }
            for i in range(prompts)
        ]
        write_jsonl_zst(path, rows)
        paths.append(path)
    return paths


def run_shards(args, prompts: list[Path], results: Path, settings: dict, server_log: Path, jobs: int) -> list[tuple]:
    """Every shard, `jobs` jobs at once, the next started as one ends; each job's (start, end) wall clock."""
    pending, running, times = list(enumerate(prompts)), {}, [None] * len(prompts)
    lengths = [args.alpha, args.min_tokens, args.max_tokens]
    while pending or running:
        while pending and len(running) < jobs:
            shard, path = pending.pop(0)
            out = results / f"{shard:05d}.jsonl.zst"
            shard_paths = [str(path), str(out), str(results / f"{shard:05d}.stats.json")]
            job = {"shard": shard_paths, "settings": settings, "server_log": str(server_log), "lengths": lengths}
            command = [sys.executable, __file__, "--job", json.dumps(job)]
            log = open(results / f"{shard:05d}.log", "w")  # noqa: SIM115 (closed when the job ends)
            running[shard] = (subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO), log)
            times[shard] = [time.time(), None]
        for shard, (process, log) in list(running.items()):
            if process.poll() is not None:
                log.close()
                if process.returncode:
                    sys.exit(f"shard {shard} failed: {(results / f'{shard:05d}.log').read_text()[-3000:]}")
                times[shard][1] = time.time()
                del running[shard]
        time.sleep(0.05)
    return [tuple(t) for t in times]


def decode_steps(server_log: Path, since: float) -> list[tuple[int, int]]:
    """(second, running requests) of each decode step the server logged from `since` on."""
    steps = []
    for line in server_log.read_text(errors="replace").splitlines():
        if m := DECODE.match(line):
            second = int(datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S").timestamp())
            if second >= int(since):
                steps.append((second, int(m[2])))
    return steps


def fractions(steps: list[tuple[int, int]], start: int, end: int, concurrency: int) -> tuple[float, float]:
    """Over the whole seconds [start, end): the share with a request running, and the mean occupancy."""
    per_second: dict[int, list[int]] = {}
    for second, running in steps:
        per_second.setdefault(second, []).append(running)
    seconds = range(start, end)
    busy = sum(any(per_second.get(s, [])) for s in seconds)
    occupancy = sum(
        sum(min(r, concurrency) for r in per_second[s]) / len(per_second[s]) / concurrency
        for s in seconds
        if s in per_second
    )
    return busy / len(seconds), occupancy / len(seconds)


def measure(args, prompts, work: Path, settings, server_log: Path, jobs: int) -> dict:
    results = work / f"results-{jobs}-jobs"
    results.mkdir()
    since = time.time()
    times = run_shards(args, prompts, results, settings, server_log, jobs)
    steps = decode_steps(server_log, since)
    first = min(s for s, r in steps if r)
    # The window ends when the second-to-last shard's job does: every boundary, not the run's last tail.
    last_boundary = sorted(end for _, end in times)[-2]
    busy, occupancy = fractions(steps, first, int(last_boundary) + 1, args.concurrency)
    around = [fractions(steps, int(end - args.boundary_s), int(end + args.boundary_s) + 1, args.concurrency)
              for end in sorted(end for _, end in times)[:-1]]  # fmt: skip
    rows = sum(1 for f in results.glob("*.jsonl.zst") for _ in _rows(f))
    return {
        "shard_jobs": jobs,
        "wall_s": round(max(e for _, e in times) - min(s for s, _ in times), 1),
        "window_s": int(last_boundary) + 1 - first,
        "busy": round(busy, 3),
        "occupancy": round(occupancy, 3),
        "boundary_busy": round(sum(b for b, _ in around) / len(around), 3),
        "boundary_occupancy": round(sum(o for _, o in around) / len(around), 3),
        "rows": rows,
    }


def _rows(path: Path):
    from eagle3_datagen.formats.files import read_jsonl

    return read_jsonl(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", type=int, default=6)
    p.add_argument("--prompts", type=int, default=16, help="prompts per shard")
    p.add_argument("--concurrency", type=int, default=8, help="the server's running requests at most")
    p.add_argument("--shard-jobs", type=int, default=2, help="jobs at once, the after run")
    p.add_argument("--alpha", type=float, default=1.2, help="the answer lengths' Pareto tail index")
    p.add_argument("--min-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--boundary-s", type=float, default=30.0, help="seconds either side of a shard job's end")
    p.add_argument("--job", type=json.loads, help=argparse.SUPPRESS)  # run one shard job (this bench's own)
    args = p.parse_args()
    if args.job:
        run_job(args.job)
        return
    from eagle3_datagen.backends.service.lease import request_stop
    from eagle3_datagen.backends.service.record import node_dir
    from tests.helpers import free_port
    from tests.helpers.sglang_cpu import CPU_DIR, SGLANG_CPU_ENV

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # SGLang's CPU settings, and a node directory of the bench's own for the server's records
        os.environ.update(SGLANG_CPU_ENV, TMPDIR=str(work))
        tempfile.tempdir = None
        sys.path.insert(0, str(CPU_DIR))
        model = write_model(work / "Tiny-Served")
        prompts = write_shards(work, args.shards, args.prompts)
        settings = job_settings(model, f"http://127.0.0.1:{free_port()}", args.concurrency, args.max_tokens)
        server_log = work / "server.log"
        try:
            measured = [measure(args, prompts, work, settings, server_log, jobs) for jobs in (1, args.shard_jobs)]
        finally:
            with contextlib.suppress(Exception):
                request_stop(node_dir())
                time.sleep(5)
        result = {"shards": args.shards, "prompts_per_shard": args.prompts, "concurrency": args.concurrency}
        result["runs"] = measured
        print(json.dumps(result))


if __name__ == "__main__":
    main()
