"""The run-wide ledger of an endpoint (backends/ledger.py) under the responses driver: fair shares, a
killed job's share returned, the spend under results/ counted (and counted again from the files when the
ledger is gone), a refused setting stopping every job, the statuses that stop a run. The jobs are the
real driver and `scripts/responses.py`; the server is the loopback double (tests/doubles)."""

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
from eagle3_datagen.backends.ledger import (
    STALE_S,
    Ledger,
    Reserved,
    Synced,
    clear_stop,
    endpoint_key,
    fair_shares,
    oldest_first_shares,
)
from eagle3_datagen.formats.files import read_jsonl
from eagle3_datagen.formats.spend import Spend
from eagle3_datagen.stages.responses.journaled import Budgets, IncompleteRun, run_journaled_responses
from tests.doubles.loopback import FaultPlan, Loopback, serve_in_thread
from tests.helpers import KEY_ENV, REPO, SAMPLING, defaults, openrouter_backend, prompts_file, wait_until

MODEL = "moonshotai/kimi-k2.5"
# USD per million tokens the loopback bills and the budget reserves at
PRICES = {"prompt": 10.0, "completion": 50.0}


def test_fair_shares_split_evenly_and_give_what_a_job_does_not_want_to_the_others():
    assert fair_shares(40, {"a": 40, "b": 40, "c": 40, "d": 40}) == {"a": 10, "b": 10, "c": 10, "d": 10}
    assert fair_shares(40, {"a": 3, "b": 100, "c": 100}) == {"a": 3, "b": 19, "c": 18}
    assert fair_shares(2000, {"a": 2000} | {f"j{i:02d}": 2000 for i in range(31)})["a"] == 63
    assert fair_shares(10, {"a": 0, "b": 2}) == {"a": 0, "b": 2}


def test_oldest_first_shares_give_the_first_job_its_want_and_the_next_what_its_tail_leaves():
    # a node's server (288 slots): the shard under way takes all it wants, the next one waits ...
    assert oldest_first_shares(288, {"b": 288, "a": 288}, {"a": 1, "b": 2}) == {"a": 288, "b": 0}
    # ... and takes what the first one's tail of long answers leaves
    assert oldest_first_shares(288, {"b": 288, "a": 17}, {"a": 1, "b": 2}) == {"a": 17, "b": 271}
    assert oldest_first_shares(8, {"a": 3, "b": 4, "c": 8}, {"a": 5, "b": 6, "c": 7}) == {"a": 3, "b": 4, "c": 1}


def test_a_servers_jobs_share_it_oldest_first_and_never_claim_more_than_it_has(tmp_path):
    """Two jobs of one process stand in for two processes: a ledger's place is its own `me`."""
    first = Ledger(tmp_path, "sglang", "m", "results/p/responses/00000.jsonl.zst", 8, tmp_path, oldest_first=True)
    second = Ledger(tmp_path, "sglang", "m", "results/p/responses/00001.jsonl.zst", 8, tmp_path, oldest_first=True)
    second.me = second.me + ":second"
    assert first.sync(0, 40, Spend(), 0.0).limit == 8
    assert second.sync(0, 40, Spend(), 0.0).limit == 0  # the first one's 8 are claimed
    assert first.sync(8, 8, Spend(), 0.5).limit == 8  # every conversation started: the tail
    assert first.sync(3, 3, Spend(), 1.0).limit == 3  # 5 long answers ended, 3 still run
    assert second.sync(0, 40, Spend(), 1.0).limit == 5
    first.leave(Spend())
    assert second.sync(5, 40, Spend(), 1.5).limit == 8


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


def worst_case(prompts) -> float:
    """The largest first-turn reservation of `prompts` (tests.helpers' SAMPLING: max_new_tokens 64), in USD."""
    budgets = Budgets(cost_usd=1.0, prices=PRICES)
    return max(budgets.worst_case(p["messages"], None, 64).cost for p in read_jsonl(prompts))


def ledger_total(tmp_path) -> float:
    ledger = tmp_path / "results" / ".ledger" / endpoint_key("openrouter", MODEL) / "ledger.json"
    return sum(entry["cost"] for entry in json.loads(ledger.read_text())["shards"].values())


def test_the_spend_under_results_counts_and_a_lost_ledger_is_counted_again_from_it(tmp_path, api_key):
    """Shard 0 answered in full, then shard 1 under a budget: it stops once the next request's worst case
    no longer fits beside the run's spend (shard 0's included), never past the budget. With the ledger
    deleted, the next job counts the journals again and stops at the same place under the same budget."""
    server = Loopback("unused", api_key=api_key, prices=PRICES)
    with serve_in_thread(server) as url:
        run_shard(tmp_path, prompts_file(tmp_path, 10, name="a.jsonl.zst"), url, 0)
        first = server.billed
        prompts = prompts_file(tmp_path, 10, name="b.jsonl.zst")
        worst = worst_case(prompts)
        budget = first + worst + 0.002  # room for a few answers at about $0.0006 each
        with pytest.raises(
            IncompleteRun, match=r"the budget is reached: the run's \$0\.0\d+ .* spent leave too little"
        ):
            run_shard(tmp_path, prompts, url, 1, Budgets(cost_usd=budget, prices=PRICES), concurrency=1)
        answered = sum(server.completed.values())
        assert 10 + 3 <= answered < 20 and server.billed <= budget < server.billed + worst
        assert ledger_total(tmp_path) == pytest.approx(server.billed)
        (tmp_path / "results" / ".ledger" / endpoint_key("openrouter", MODEL) / "ledger.json").unlink()
        with pytest.raises(IncompleteRun, match="the budget is reached"):
            run_shard(tmp_path, prompts, url, 1, Budgets(cost_usd=budget, prices=PRICES), concurrency=1)
        assert sum(server.completed.values()) == answered  # the journals counted again: nothing more asked
        assert ledger_total(tmp_path) == pytest.approx(server.billed)


def test_failed_prompts_paid_turns_stay_counted_on_a_rerun(tmp_path, api_key):
    """Two-turn prompts whose second turn is refused (a 400 for the prompt): each failed row's paid first
    turn is in the journal. A rerun asks for them again (failed rows are not kept), and the ledger and the
    finished shard's stats still count the first run's paid turns: the whole bill, not the kept rows'."""
    server = Loopback(
        "unused", api_key=api_key, prices=PRICES, faults=FaultPlan(reject=["Question 3.1", "Question 5.1"])
    )
    prompts = prompts_file(tmp_path, 8, turns=2, name="a.jsonl.zst")
    with serve_in_thread(server) as url:
        stats = run_shard(tmp_path, prompts, url, 0)
        assert stats["status"] == {"ok": 6, "failed": 2}
        assert stats["spent"]["cost"] == pytest.approx(server.billed)
        server.faults = FaultPlan()
        results_shard(tmp_path, 0).unlink()  # Snakemake deletes the output before it runs the job again
        stats = run_shard(tmp_path, prompts, url, 0)
    assert stats["status"] == {"ok": 8}
    # 16 answers in the output, 18 billed: the 2 failed rows' first turns were paid in the first run
    assert sum(server.completed.values()) == 18
    assert stats["spent"]["cost"] == pytest.approx(server.billed) and ledger_total(tmp_path) == pytest.approx(
        server.billed
    )
    assert stats["usage"]["cost"] < server.billed
    (tmp_path / "results" / ".ledger" / endpoint_key("openrouter", MODEL) / "ledger.json").unlink()
    recounted = Ledger(tmp_path / "results" / ".ledger", "openrouter", MODEL, "other", None)
    assert recounted.sync(0, 0, Spend(), 0.0).total.cost == pytest.approx(server.billed)


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


def job_command(tmp_path, prompts, shard: int, url: str, openrouter_run: dict | None = None) -> list[str]:
    out = results_shard(tmp_path, shard)
    settings = {
        "backend": "openrouter",
        "sampling": SAMPLING,
        "openrouter": defaults("inference.openrouter", base_url=url, model=MODEL, api_key_env=KEY_ENV),
        "model": defaults("model", path="unused"),
    }
    run = {"openrouter": {"concurrency": 40, **(openrouter_run or {})}, "ledger_dir": "results/.ledger"}
    run["max_failed_rate"] = 0.0
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
    assert "is gone; its 40 slots and its reservations" in second.stderr
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


def test_a_reservation_fits_beside_the_spend_and_every_live_jobs_reservations_and_a_dead_jobs_return(tmp_path):
    """Another node's job holds $0.04 of a $0.05 budget in reservations: a request worth $0.02 at worst
    waits. Once that job settles (its answers cost $0.01) the request fits; once its heartbeat stands still
    for STALE_S its reservations return with it."""
    ledger = Ledger(tmp_path / ".ledger", "openrouter", MODEL, "results/p/responses/00000.jsonl.zst", 40)
    budgets = Budgets(cost_usd=0.05, prices=PRICES)
    ledger.sync(0, 100, Spend(), now=0.0)
    other = {"host": "node7/0badc0de", "pid": 1, "pid_start": "1", "shard": "s1", "beat": 1, "want": 40, "claim": 20}

    def other_job(beat: int, reserved: float, spent: float) -> None:
        state = json.loads(ledger.path.read_text())
        state["jobs"]["node7/0badc0de:1:1"] = {**other, "beat": beat, "reserved": {"cost": reserved, "tokens": 9000}}
        state["shards"]["s1"] = {"cost": spent, "tokens": 100}
        ledger.path.write_text(json.dumps(state))

    worst = Spend(0.02, 4000)
    other_job(1, 0.04, 0.0)
    found = ledger.reserve(worst, Spend(), Spend(), budgets.fits, now=1.0)
    assert found == Reserved(False, Spend(0.0, 100), Spend(0.04, 9000))
    other_job(2, 0.0, 0.01)
    assert ledger.reserve(worst, Spend(), Spend(), budgets.fits, now=2.0).held
    assert json.loads(ledger.path.read_text())["jobs"][ledger.me]["reserved"] == {"cost": 0.02, "tokens": 4000}
    assert not ledger.reserve(worst, worst + worst, Spend(), budgets.fits, now=3.0).held  # 0.01 + 3 x 0.02
    other_job(3, 0.03, 0.01)
    assert not ledger.reserve(worst, Spend(), Spend(), budgets.fits, now=4.0).held
    found = ledger.reserve(worst, Spend(), Spend(), budgets.fits, now=4.0 + STALE_S + 1)
    assert found.held and found.reserved == Spend()  # the dead job's $0.03 returned, its spend stays
    assert found.total == Spend(0.01, 100)
    ledger.settle(Spend(), Spend(0.015, 3000))
    state = json.loads(ledger.path.read_text())
    assert state["jobs"][ledger.me]["reserved"] == {"cost": 0.0, "tokens": 0}
    assert state["shards"]["results/p/responses/00000.jsonl.zst"] == {"cost": 0.015, "tokens": 3000}


def test_spend_under_a_cap_with_slow_answers_and_a_job_killed_with_9_stays_within_the_bound(tmp_path, api_key):
    """Two jobs of 150 two-turn prompts share 40 slots and a $0.15 budget (about 220 of their 600 answers);
    every answer takes 1 s. The first is killed with -9 while 10 or more of its requests are in flight
    (their answers are billed all the same) and the second is started as it dies; the second runs on, then the
    first is run again. The bill passes the budget by no more than the killed job's reservations at the kill
    (docs/backends.md), and the recorded spend never passes it. The second starts once the first holds its 10:
    started together on a loaded machine, the second could spend the whole budget before the first's Python
    had started (CI: the first never held 10)."""
    server = Loopback("unused", api_key=api_key, prices=PRICES, faults=FaultPlan(latency_s=1.0))
    ledger = tmp_path / "results" / ".ledger" / endpoint_key("openrouter", MODEL) / "ledger.json"
    env = {**os.environ, KEY_ENV: api_key}
    budget = {"max_cost_usd": 0.15, "price_per_million": PRICES}
    with serve_in_thread(server) as url:
        results_shard(tmp_path, 0).parent.mkdir(parents=True)
        shards = [prompts_file(tmp_path, 150, turns=2, name=f"{n}.jsonl.zst") for n in "ab"]

        def start(job: int) -> subprocess.Popen:
            return subprocess.Popen(job_command(tmp_path, shards[job], job, url, budget), cwd=tmp_path, env=env,
                                    stderr=subprocess.PIPE, text=True)  # fmt: skip

        def reserved(job: int) -> dict:
            state = json.loads(ledger.read_text() or "{}")
            mine = [j for j in state.get("jobs", {}).values() if j["shard"].endswith(f"{job:05d}.jsonl.zst")]
            return mine[0]["reserved"] if mine else {"cost": 0.0}

        worst = worst_case(shards[0])
        jobs = [start(0)]
        assert wait_until(
            lambda: ledger.exists() and server.completed and reserved(0)["cost"] >= 10 * worst, interval=0.02
        )
        held_at_kill = reserved(0)["cost"]
        jobs.append(start(1))
        jobs[0].send_signal(signal.SIGKILL)
        jobs[0].wait()
        second = jobs[1].communicate()[1]
        rerun = subprocess.run(job_command(tmp_path, shards[0], 0, url, budget), cwd=tmp_path, env=env,
                               capture_output=True, text=True)  # fmt: skip
        time.sleep(1.5)  # the killed job's last answers come back to no one, billed
    assert jobs[1].returncode != 0 and "the budget is reached" in second, second[-2000:]
    assert "and its reservations" in second + rerun.stderr  # the killed job found dead
    assert rerun.returncode != 0 and "budget" in rerun.stderr, rerun.stderr[-2000:]
    recorded = ledger_total(tmp_path)
    overshoot = server.billed - budget["max_cost_usd"]
    print(
        f"\nbudget $0.15: billed ${server.billed:.4f} ({sum(server.completed.values())} answers), recorded "
        f"${recorded:.4f}; overshoot ${max(overshoot, 0):.4f} <= the killed job's reservations ${held_at_kill:.4f}"
    )
    assert recorded <= budget["max_cost_usd"] and overshoot <= held_at_kill
    assert json.loads(ledger.read_text())["jobs"] == {}
