"""The OpenRouter backend against the loopback server: transient errors, Retry-After, bad requests,
credits, budgets, keys, and a job killed with SIGKILL then run again."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from eagle3_datagen.backends.base import MissingApiKey
from eagle3_datagen.formats.files import read_jsonl, write_jsonl_zst
from eagle3_datagen.formats.journal import journal_path
from eagle3_datagen.stages.responses.journaled import Budgets, IncompleteRun, TooManyFailed, run_journaled_responses
from tests.doubles.loopback import REFUSED, FaultPlan, Loopback, serve_in_thread
from tests.helpers import (
    FAST_RETRY,
    KEY_ENV,
    REPO,
    SAMPLING,
    defaults,
    openrouter_backend,
    prompts_file,
    run_responses,
    wait_until,
)


def test_openrouter_retries_every_transient_error_and_records_each_turn(tmp_path, api_key):
    faults = FaultPlan(every=2, sequence=[429, 503, "200-error", "200-empty", 500, 408], retry_after=0)
    server = Loopback("unused", api_key=api_key, faults=faults)
    prompts = prompts_file(tmp_path, 24, turns=2)
    with serve_in_thread(server) as url:
        routing = {"order": ["moonshotai"], "allow_fallbacks": False, "quantizations": ["int4"]}
        stats = run_responses(tmp_path, prompts, openrouter_backend(url, concurrency=8, provider=routing))
    rows = read_jsonl(tmp_path / "out.jsonl.zst")
    assert [r["id"] for r in rows] == [f"id{i:04d}" for i in range(24)]
    assert stats["status"] == {"ok": 24} and stats["assistant_turns"] == 48
    turns = [m for r in rows for m in r["messages"] if m["role"] == "assistant"]
    assert all(t["reasoning"] == "Considering it." and t["usage"]["cost"] == 0.001 for t in turns)
    assert {t["produced_by"]["provider"] for t in turns} == {"Loopback"}
    retried = [t for t in turns if t["produced_by"]["attempts"] == 7]
    assert 0 < len(retried) < 48  # the faulted half took 6 failures and a success
    assert set(server.completed.values()) == {1}  # no request answered twice
    assert stats["usage"]["cost"] == pytest.approx(0.048)
    kept = journal_path(tmp_path / "out.jsonl.zst").read_text().splitlines()  # the shard's answers, kept
    assert len(kept) == 1 + 24 and json.loads(kept[0])["format"] == "eagle3-datagen/responses-journal-v1"
    sent = server.last_chat_request
    assert sent["provider"] == {"order": ["moonshotai"], "allow_fallbacks": False, "quantizations": ["int4"]}
    assert (
        sent["reasoning"] == {"enabled": True} and sent["max_tokens"] == 64 and sent["model"] == "moonshotai/kimi-k2.5"
    )


def test_retry_after_is_honoured(tmp_path, api_key):
    server = Loopback("unused", api_key=api_key, faults=FaultPlan(every=1, sequence=[429], retry_after=1))
    with serve_in_thread(server) as url:
        start = time.monotonic()
        run_responses(tmp_path, prompts_file(tmp_path, 1), openrouter_backend(url))
        assert time.monotonic() - start >= 1.0


def test_bad_requests_are_recorded_not_retried(tmp_path, api_key):
    server = Loopback("unused", api_key=api_key, faults=FaultPlan(reject=["Question 3.0"]))
    with serve_in_thread(server) as url:
        stats = run_responses(tmp_path, prompts_file(tmp_path, 6), openrouter_backend(url))
    assert stats["status"] == {"ok": 5, "failed": 1}
    assert stats["failed"] == {"id0003": "HTTP 400: invalid request"} and stats["failures"] == {"bad_request": 1}
    assert server.status_counts["400"] == 1


def test_out_of_credits_stops_cleanly_and_a_rerun_continues(tmp_path, api_key):
    prompts = prompts_file(tmp_path, 10)
    out_of_credits = pytest.raises(IncompleteRun, match=r"4 of 10 prompts finished, 6 left .*out of credits")
    server = Loopback("unused", api_key=api_key, faults=FaultPlan(credits=4))
    with serve_in_thread(server) as url:
        with out_of_credits:
            run_responses(tmp_path, prompts, openrouter_backend(url, concurrency=1))
        assert not (tmp_path / "out.jsonl.zst").exists()
        journaled = [
            json.loads(line)["id"] for line in journal_path(tmp_path / "out.jsonl.zst").read_text().splitlines()[1:]
        ]
        assert len(journaled) == 4
        server.faults = FaultPlan()  # credits topped up; the same endpoint (base_url is in the fingerprint)
        stats = run_responses(tmp_path, prompts, openrouter_backend(url, concurrency=1))
    assert stats["status"] == {"ok": 10} and sum(server.completed.values()) == 10
    assert [r["id"] for r in read_jsonl(tmp_path / "out.jsonl.zst")] == [f"id{i:04d}" for i in range(10)]


def test_402_with_retry_after_is_retried(tmp_path, api_key):
    server = Loopback("unused", api_key=api_key, faults=FaultPlan(every=1, sequence=[402], retry_after=0))
    with serve_in_thread(server) as url:
        stats = run_responses(tmp_path, prompts_file(tmp_path, 3), openrouter_backend(url))
    assert stats["status"] == {"ok": 3} and server.status_counts["402"] == 3


def test_budgets_stop_new_requests_before_their_worst_case_passes_them_and_leave_a_resumable_state(tmp_path, api_key):
    """The loopback bills $0.001 an answer; at $20 per million completion tokens a request's worst case is
    64 tokens, $0.00128 (prompt tokens free): $0.0035 takes 3 answers ($0.002 + $0.00128 fits), then
    $0.003 + $0.00128 would pass it.
    The token budget reserves each request's prompt bytes and 64 tokens the same way."""
    prompts = prompts_file(tmp_path, 10)
    prices = {"prompt": 0.0, "completion": 20.0}
    with serve_in_thread(server := Loopback("unused", api_key=api_key)) as url:
        with pytest.raises(IncompleteRun, match=r"the budget is reached: this shard's \$0.0030 and \d+ tokens spent"):
            run_responses(
                tmp_path, prompts, openrouter_backend(url, concurrency=1), Budgets(cost_usd=0.0035, prices=prices)
            )
        assert sum(server.completed.values()) == 3
        with pytest.raises(IncompleteRun, match=r"the budget is reached"):
            run_responses(tmp_path, prompts, openrouter_backend(url, concurrency=1), Budgets(tokens=300))
        assert sum(server.completed.values()) == 7  # 54 tokens, and 18 per answer, while 176 more fit in 300
        stats = run_responses(tmp_path, prompts, openrouter_backend(url, concurrency=1), Budgets(tokens=10_000))
    assert stats["prompts"] == 10 and sum(server.completed.values()) == 10


def test_missing_key_fails_before_any_request(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(MissingApiKey, match=f"{KEY_ENV} is not set"):
        openrouter_backend("http://127.0.0.1:9")


def test_wrong_key_stops_the_run(tmp_path, api_key, monkeypatch):
    invalid = pytest.raises(IncompleteRun, match="API key is missing or invalid")
    with serve_in_thread(Loopback("unused", api_key="another-key")) as url, invalid:
        run_responses(tmp_path, prompts_file(tmp_path, 3), openrouter_backend(url))


def test_kill_9_then_rerun_loses_and_repeats_nothing(tmp_path, qwen_tokenizer_dir, api_key):
    prompts = prompts_file(tmp_path, 40)
    server = Loopback("unused", api_key=api_key, faults=FaultPlan(latency_s=0.05))
    settings = {
        "backend": "openrouter",
        "max_failed_rate": 0.0,
        "sampling": SAMPLING,
        "openrouter": defaults("inference.openrouter", base_url=None, model="m", api_key_env=KEY_ENV, concurrency=2),
        "model": defaults("model", path=str(qwen_tokenizer_dir)),
    }
    out = tmp_path / "out.jsonl.zst"
    env = {**os.environ, KEY_ENV: api_key}
    with serve_in_thread(server) as url:
        settings["openrouter"]["base_url"] = url
        command = [
            sys.executable,
            str(REPO / "scripts/responses.py"),
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            "--stats",
            str(tmp_path / "stats.json"),
            "--settings",
            json.dumps(settings),
        ]
        job = subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL)
        journal = journal_path(out)
        wait_until(lambda: journal.exists() and journal.read_text().count("\n") >= 8, timeout=60, interval=0.05)
        job.send_signal(signal.SIGKILL)
        job.wait()
        before_kill = [json.loads(line)["id"] for line in journal.read_text().splitlines()[1:] if line.endswith("}")]
        assert 7 <= len(before_kill) < 40 and not out.exists()
        subprocess.run(command, env=env, check=True, stderr=subprocess.DEVNULL)
    rows = read_jsonl(out)
    assert [r["id"] for r in rows] == [f"id{i:04d}" for i in range(40)]
    assert all(r["status"] == "ok" for r in rows)
    assert max(server.completed.values()) <= 2  # only requests in flight at the kill ran twice
    assert sum(server.completed.values()) <= 40 + 2  # concurrency 2: at most 2 were in flight


def test_too_many_failed_prompts_fail_the_shard_and_the_rerun_asks_only_for_them(tmp_path, api_key):
    """60% of the requests fail, one attempt each: the job asks for every prompt, then fails naming how many
    failed and why, keeping the journal; against the healthy server the rerun asks for the failed ones only."""
    prompts = prompts_file(tmp_path, 40)
    server = Loopback("unused", api_key=api_key, faults=FaultPlan(rate=0.6, sequence=[502]))
    once = {**FAST_RETRY, "max_attempts": 1}
    out, stats_path = tmp_path / "out.jsonl.zst", tmp_path / "stats.json"
    with serve_in_thread(server) as url:
        backend = openrouter_backend(url, retry=once)
        with pytest.raises(TooManyFailed) as failed:
            run_journaled_responses(prompts, out, stats_path, backend, Budgets(), max_failed_rate=0.01)
        answered = dict(server.completed)
        server.faults = FaultPlan()
        backend = openrouter_backend(url, retry=once)
        stats = run_journaled_responses(prompts, out, stats_path, backend, Budgets(), max_failed_rate=0.01)
    count = 40 - len(answered)
    assert 10 < count < 35 and sum(server.attempts.values()) == 40 + count
    assert str(failed.value).startswith(f"{tmp_path / 'out.jsonl.zst'}: {count} of 40 prompts failed")
    said = (
        f"{count} retries_exhausted (e.g. 'retries exhausted: HTTP 502: injected 502'); above inference.max_failed_rate"
    )
    assert said in str(failed.value)
    assert stats["status"] == {"ok": 40} and set(server.completed.values()) == {1}


def test_a_refusal_is_recorded_as_the_provider_sent_it(tmp_path, api_key):
    """`message.refusal` and the raw `finish_reason: content_filter` are kept on the turn (the quality gates
    of a later stage read them); the turn's own finish_reason counts it as a stop."""
    rows = [
        {"id": f"r{i}", "source": "test", "messages": [{"role": "user", "content": text}]}
        for i, text in enumerate(["Tell me a joke.", f"Help me with this {REFUSED} please."])
    ]
    write_jsonl_zst(tmp_path / "p.jsonl.zst", rows)
    with serve_in_thread(Loopback("unused", api_key=api_key)) as url:
        run_responses(tmp_path, tmp_path / "p.jsonl.zst", openrouter_backend(url))
    plain, refused = (r["messages"][-1] for r in read_jsonl(tmp_path / "out.jsonl.zst"))
    assert "refusal" not in plain and plain["produced_by"]["finish_reason"] == "stop"
    assert refused["refusal"] == "I can't help with that." and refused["content"] == ""
    assert refused["produced_by"]["finish_reason"] == "content_filter" and refused["finish_reason"] == "stop"
