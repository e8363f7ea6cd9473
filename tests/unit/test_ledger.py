"""The run-wide ledger of an endpoint (backends/ledger.py) under the responses driver: fair shares, a
killed job's share returned, the spend under results/ counted (and counted again from the files when the
ledger is gone), a refused setting stopping every job, the statuses that stop a run. The jobs are the
real driver and `scripts/responses.py`; the server is the loopback double (tests/doubles)."""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from eagle3_datagen.backends.base import RequestFailed, RetryableError, StopRun
from eagle3_datagen.backends.http import classify
from eagle3_datagen.backends.ledger import STALE_S, Ledger, Spend, Synced, clear_stop, endpoint_key, fair_shares
from eagle3_datagen.formats.files import read_jsonl
from eagle3_datagen.stages.responses.journaled import Budgets, IncompleteRun, run_journaled_responses
from eagle3_datagen.stages.responses.limits import Limits
from tests.doubles.loopback import FaultPlan, Loopback, serve_in_thread
from tests.helpers import KEY_ENV, REPO, SAMPLING, defaults, openrouter_backend, prompts_file, wait_until

MODEL = "moonshotai/kimi-k2.5"


def test_fair_shares_split_evenly_and_give_what_a_job_does_not_want_to_the_others():
    assert fair_shares(40, {"a": 40, "b": 40, "c": 40, "d": 40}) == {"a": 10, "b": 10, "c": 10, "d": 10}
    assert fair_shares(40, {"a": 3, "b": 100, "c": 100}) == {"a": 3, "b": 19, "c": 18}
    assert fair_shares(2000, {"a": 2000} | {f"j{i:02d}": 2000 for i in range(31)})["a"] == 63
    assert fair_shares(10, {"a": 0, "b": 2}) == {"a": 0, "b": 2}


def error(code: int, message: str, **metadata) -> dict:
    return {"error": {"code": code, "message": message, **({"metadata": metadata} if metadata else {})}}


@pytest.mark.parametrize(
    ("status", "body", "kind"),
    [
        (400, error(400, "invalid temperature: only 1 is allowed"), StopRun),
        (400, error(400, "Provider returned error: unsupported parameter: seed"), StopRun),
        (400, error(400, "This model's maximum context length is 262144 tokens"), RequestFailed),
        (400, error(400, "invalid request"), RequestFailed),
        (403, error(403, "Input flagged", reasons=["harassment"], flagged_input="..."), RequestFailed),
        (403, error(403, "Key limit exceeded"), StopRun),
        (404, error(404, "No endpoints found that support the requested parameters"), StopRun),
        (402, error(402, "Insufficient credits"), StopRun),
        (503, error(503, "No provider available"), RetryableError),
    ],
)
def test_answers_that_fail_every_request_stop_the_run_and_those_about_one_prompt_fail_it(status, body, kind):
    error = classify(status, body, None)
    assert type(error) is kind and body["error"]["message"] in str(error)


def results_shard(tmp_path, shard: int):
    return tmp_path / "results" / "p" / "responses" / f"{shard:05d}.jsonl.zst"


def run_shard(tmp_path, prompts, url, shard, budgets=None, concurrency=4):
    out = results_shard(tmp_path, shard)
    out.parent.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(tmp_path / "results" / ".ledger", "openrouter", MODEL, str(out), concurrency)
    backend = openrouter_backend(url, concurrency=concurrency)
    return run_journaled_responses(
        prompts, out, out.with_name(f"{shard:05d}.stats.json"), backend, budgets or Budgets(), ledger=ledger
    )


def test_the_spend_under_results_counts_and_a_lost_ledger_is_counted_again_from_it(tmp_path, api_key):
    """Shard 0 answered in full (10 x $0.001), then shard 1 under a budget of $0.015: the run's spend stops
    it at about 5 more. With the ledger deleted, the next job counts the journals again."""
    server = Loopback("unused", api_key=api_key)
    with serve_in_thread(server) as url:
        run_shard(tmp_path, prompts_file(tmp_path, 10, name="a.jsonl.zst"), url, 0)
        prompts = prompts_file(tmp_path, 10, name="b.jsonl.zst")
        with pytest.raises(IncompleteRun, match=r"max_cost_usd=0.015 reached \(\$0.0150 spent by the run\)"):
            run_shard(tmp_path, prompts, url, 1, Budgets(cost_usd=0.015), concurrency=1)
        assert sum(server.completed.values()) == 15
        ledger = tmp_path / "results" / ".ledger" / endpoint_key("openrouter", MODEL) / "ledger.json"
        recorded = json.loads(ledger.read_text())
        assert recorded["jobs"] == {} and sorted(e["cost"] for e in recorded["shards"].values()) == [0.005, 0.01]
        ledger.unlink()
        with pytest.raises(IncompleteRun, match=r"max_cost_usd=0.017 reached \(\$0.0170 spent by the run\)"):
            run_shard(tmp_path, prompts, url, 1, Budgets(cost_usd=0.017), concurrency=1)
        assert sum(server.completed.values()) == 17


def test_a_refused_setting_stops_every_job_until_the_canary_clears_it(tmp_path, api_key):
    """Shard 0's first answers are a 400 naming the temperature: the job stops (at most its 4 requests in
    flight) and records the stop; shard 1 then sends nothing. Once the canary is answered (here: the stop
    cleared as it clears it), shard 1 runs."""
    server = Loopback("unused", api_key=api_key, faults=FaultPlan(require={"temperature": 1.0}))
    with serve_in_thread(server) as url:
        with pytest.raises(IncompleteRun, match="0 of 20 prompts finished.*invalid temperature: only 1.0 is allowed"):
            run_shard(tmp_path, prompts_file(tmp_path, 20, name="a.jsonl.zst"), url, 0)
        sent = sum(server.attempts.values())
        assert 1 <= sent <= 4
        prompts = prompts_file(tmp_path, 6, name="b.jsonl.zst")
        with pytest.raises(IncompleteRun, match="the run was stopped: HTTP 400: invalid temperature"):
            run_shard(tmp_path, prompts, url, 1)
        assert sum(server.attempts.values()) == sent
        server.faults = FaultPlan()
        assert clear_stop(tmp_path / "results" / ".ledger", "openrouter", MODEL)
        assert run_shard(tmp_path, prompts, url, 1)["status"] == {"ok": 6}


def job_command(tmp_path, prompts, shard: int, url: str) -> list[str]:
    out = results_shard(tmp_path, shard)
    settings = {
        "backend": "openrouter",
        "sampling": SAMPLING,
        "openrouter": defaults("inference.openrouter", base_url=url, model=MODEL, api_key_env=KEY_ENV),
        "model": defaults("model", path="unused"),
    }
    run = {"openrouter": {"concurrency": 40}, "ledger_dir": "results/.ledger", "max_failed_rate": 0.0}
    return [sys.executable, str(REPO / "scripts/responses.py"), "--prompts", str(prompts), "--out",
            str(out.relative_to(tmp_path)), "--stats", str(out.with_suffix(".stats").relative_to(tmp_path)),
            "--settings", json.dumps(settings), "--run-settings", json.dumps(run)]  # fmt: skip


def test_a_job_killed_with_9_returns_its_share(tmp_path, api_key):
    """A job holding the whole concurrency (40) is killed with -9; the next job on the host finds its pid
    gone and takes the 40 at its first look, without waiting for a heartbeat to go stale."""
    server = Loopback("unused", api_key=api_key, faults=FaultPlan(latency_s=1.0))
    ledger = tmp_path / "results" / ".ledger" / endpoint_key("openrouter", MODEL) / "ledger.json"
    env = {**os.environ, KEY_ENV: api_key}
    with serve_in_thread(server) as url:
        results_shard(tmp_path, 0).parent.mkdir(parents=True)
        first = subprocess.Popen(
            job_command(tmp_path, prompts_file(tmp_path, 200, name="a.jsonl.zst"), 0, url),
            cwd=tmp_path,
            env=env,
            stderr=subprocess.DEVNULL,
        )

        def claims() -> list[int]:
            return [job["claim"] for job in json.loads(ledger.read_text() or "{}").get("jobs", {}).values()]

        assert wait_until(lambda: ledger.exists() and claims() == [40], timeout=60, interval=0.1)
        first.send_signal(signal.SIGKILL)
        first.wait()
        started = time.monotonic()
        second = subprocess.run(
            job_command(tmp_path, prompts_file(tmp_path, 40, name="b.jsonl.zst"), 1, url),
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
        )
        seconds = time.monotonic() - started
    assert second.returncode == 0, second.stderr[-2000:]
    shares = re.findall(r"concurrency: (\d+) of 40, (\d+) jobs", second.stderr)
    assert shares[0] == ("40", "1"), shares  # the killed job's 40 returned at the first look
    assert "is gone; its 40 slots return" in second.stderr
    assert len(read_jsonl(results_shard(tmp_path, 1))) == 40
    assert json.loads(ledger.read_text())["jobs"] == {}
    print(f"\nthe next job took the killed job's 40 slots at once; its 40 prompts at 1 s latency took {seconds:.1f} s")


def test_a_job_on_another_host_is_gone_once_its_heartbeat_stands_still_for_stale_s(tmp_path):
    """Another node's job (a host this one is not) claims 30 of 40: this job gets the other 10 while that
    job's heartbeat moves, and all 40 once it has stood still for STALE_S seconds of this job's clock."""
    ledger = Ledger(tmp_path / ".ledger", "openrouter", MODEL, "results/p/responses/00000.jsonl.zst", 40)
    spend = Spend()
    assert ledger.sync(0, 100, spend, now=0.0).limit == 40
    other = {"host": "node7/0badc0de", "pid": 1, "pid_start": "1", "shard": "s1", "beat": 1, "want": 40, "claim": 30}

    def beat(n: int) -> None:
        state = json.loads(ledger.path.read_text())
        state["jobs"]["node7/0badc0de:1:1"] = {**other, "beat": n}
        ledger.path.write_text(json.dumps(state))

    beat(1)
    assert ledger.sync(0, 100, spend, now=1.0) == Synced(limit=10, total=Spend(), stop=None, jobs=2)
    assert ledger.sync(0, 100, spend, now=1.0 + STALE_S - 1).limit == 10
    beat(2)  # it moved: alive for another STALE_S from now
    assert ledger.sync(0, 100, spend, now=1.0 + STALE_S + 5).limit == 10
    synced = ledger.sync(0, 100, spend, now=1.0 + 2 * STALE_S + 6)
    assert synced.limit == 40 and synced.jobs == 1


def test_near_the_budget_an_answers_slot_is_free_again_only_once_the_ledger_holds_its_spend(tmp_path):
    """Another job's answers are seen only through the ledger: were a slot given again before its answer's
    spend is written, a job elsewhere could start past the budget on a view without it. Each look the
    job takes while an answer is not yet written sees that answer's conversation still in flight."""
    ledger = Ledger(tmp_path / ".ledger", "openrouter", MODEL, "results/p/responses/00000.jsonl.zst", 4)
    limits = Limits(Budgets(cost_usd=0.01), 4, Spend(), ledger)
    looks = []
    sync = ledger.sync

    def looked(in_flight, wanted, spent, now, first=False):
        looks.append((in_flight, spent))
        return sync(in_flight, wanted, spent, now, first)

    ledger.sync = looked

    async def one_answer():
        async with limits:
            limits.left = 2
            assert await limits.acquire() is None
            del looks[:]
            await limits.release(Spend(0.002, 10))
            recorded = json.loads(ledger.path.read_text())["shards"]
            return limits.in_flight, recorded

    in_flight, recorded = asyncio.run(one_answer())
    assert looks == [(1, Spend(0.002, 10))]  # written with its slot still held
    assert in_flight == 0 and recorded == {"results/p/responses/00000.jsonl.zst": {"cost": 0.002, "tokens": 10}}
