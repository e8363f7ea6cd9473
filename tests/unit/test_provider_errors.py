"""The errors of OpenRouter and of the providers behind it, classified from their real bodies
(tests/fixtures/provider_errors.yaml, each with where it was read): a refused prompt is that prompt's
failure with the provider's reason, what every request sends stops the run, the rest is retried."""

import json
import time

import pytest

from eagle3_datagen.backends.base import RequestFailed, RetryableError, StopRun
from eagle3_datagen.backends.http import classify, parse_retry_after, read_error
from eagle3_datagen.backends.stream import ChatStream
from eagle3_datagen.formats.files import read_jsonl, write_jsonl_zst
from eagle3_datagen.formats.journal import journal_path, read_journal, row_spend
from eagle3_datagen.formats.spend import Spend
from eagle3_datagen.stages.responses.journaled import Budgets, IncompleteRun, TooManyFailed, run_journaled_responses
from tests.doubles.loopback import CUT, PROVIDER_ERRORS, REFUSED, FaultPlan, Loopback, ScriptedCall, serve_in_thread
from tests.helpers import FAST_RETRY, openrouter_backend, prompts_file, run_responses

CLASSES = {"RequestFailed": RequestFailed, "RetryableError": RetryableError, "StopRun": StopRun}
ANSWERS = {name: entry for name, entry in PROVIDER_ERRORS.items() if "body" in entry and entry["status"] != 200}


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_each_error_body_gets_its_class_and_reason(name):
    entry = ANSWERS[name]
    error = classify(entry["status"], entry["body"], parse_retry_after(entry.get("retry_after")))
    assert type(error) is CLASSES[entry["expect"]["class"]]
    if isinstance(error, RequestFailed):
        assert error.kind == entry["expect"]["reason"]
    said = read_error(entry["body"])
    # The message names the provider's own words, not OpenRouter's "Provider returned error".
    assert (said.raw or said.message)[:40] in str(error)
    assert "Provider returned error" not in str(error)


@pytest.mark.parametrize("name", ["error_in_200", "stream_error_midway", "stream_error_upstream_atlascloud"])
def test_an_error_after_the_status_is_classified_as_in_a_body_and_what_arrived_is_counted(name):
    """OpenRouter's mid-stream error chunk (and an error inside a 200's choice) after some text: retried, and
    the cut answer's tokens estimated from the prompt's and the arrived text's characters."""
    entry = PROVIDER_ERRORS[name]
    stream = ChatStream(prompt_chars=400, prices={"prompt": 1.0, "completion": 3.0})
    with pytest.raises(RetryableError) as raised:
        for chunk in entry.get("stream") or [entry["body"]]:
            stream.add(chunk)
    assert type(raised.value) is CLASSES[entry["expect"]["class"]]
    arrived = "".join(c["choices"][0]["delta"].get("content") or "" for c in entry.get("stream", [])[:-1])
    completion = -(-len(arrived) // 4)
    assert stream.lost() == Spend(pytest.approx((100 * 1.0 + completion * 3.0) / 1e6), 100 + completion)


def test_every_fixture_names_its_source_and_the_set_covers_each_kind():
    assert all(entry["source"].strip() for entry in PROVIDER_ERRORS.values())
    kinds = {entry["expect"].get("reason") for entry in PROVIDER_ERRORS.values()}
    assert kinds >= {"context_overflow", "moderation", "guardrail", "provider_refused", "too_large"}
    statuses = {entry["status"] for entry in PROVIDER_ERRORS.values()}
    assert statuses >= {200, 400, 401, 402, 403, 404, 408, 413, 429, 502, 503}


def test_the_issue_s_bodies_no_longer_stop_the_run():
    """Issue 44: a wrapped provider 400 ("provider") and Moonshot's overflow ("model") were read as settings."""
    for name in ("openrouter_wrapped_chutes_400", "moonshot_context_overflow", "moonshot_context_overflow_wrapped"):
        entry = PROVIDER_ERRORS[name]
        assert isinstance(classify(entry["status"], entry["body"], None), RequestFailed), name
    wrapped = classify(400, PROVIDER_ERRORS["moonshot_context_overflow_wrapped"]["body"], None)
    assert str(wrapped) == (
        "HTTP 400 from Moonshot AI: Invalid request: Your request exceeded model token limit: 262144 "
        "(requested: 269030)"
    )


def test_retry_after_is_kept_and_a_402_with_it_is_retried():
    entry = PROVIDER_ERRORS["rate_limit_429_wrapped"]
    error = classify(429, entry["body"], parse_retry_after(entry["retry_after"]))
    assert isinstance(error, RetryableError) and error.retry_after == 60.0
    assert "temporarily rate-limited upstream" in error.reason and "BaseTen" in error.reason
    assert isinstance(classify(402, PROVIDER_ERRORS["credits_402"]["body"], 5.0), RetryableError)


def test_a_wrapped_400_naming_a_sampling_parameter_stops_the_run():
    """A provider's own `param` names what it refused: a setting every request carries."""
    body = PROVIDER_ERRORS["temperature_400"]["body"]
    wrapped = {"error": {"message": "Provider returned error", "code": 400, "metadata": {"raw": json.dumps(body)}}}
    assert isinstance(classify(400, wrapped, None), StopRun)


# A run against the loopback server answering with the bodies above.

REFUSALS = {  # a user turn holding the key is answered with the body, every time
    "Question 3.0 ": "moonshot_context_overflow_wrapped",
    "Question 41.0 ": "moderation_403",
    "Question 97.0 ": "openrouter_wrapped_chutes_400",
    "Question 150.0 ": "groq_413",
    "Question 222.0 ": "guardrail_403",
}


def _rows(tmp_path):
    return {r["id"]: r for r in read_jsonl(tmp_path / "out.jsonl.zst")}


def test_a_few_refused_prompts_among_hundreds_fail_alone_and_the_shard_ends_green(tmp_path, api_key):
    """300 prompts, 5 refused by the provider, 2 more answered after a stream that ends in an error or is
    cut: the shard is written under max_failed_rate 0.02, every good prompt answered once, each refusal
    journaled with its reason and asked once, each transient stream asked twice."""
    prompts = prompts_file(tmp_path, 300)
    transient = {"Question 5.0 ": "stream_error_midway", "Question 8.0 ": CUT}
    server = Loopback("unused", api_key=api_key, faults=FaultPlan(answers=REFUSALS, answers_once=transient))
    with serve_in_thread(server) as url:
        backend = openrouter_backend(url, concurrency=16)
        stats = run_journaled_responses(
            prompts, tmp_path / "out.jsonl.zst", tmp_path / "stats.json", backend, Budgets(), max_failed_rate=0.02
        )
    rows = _rows(tmp_path)
    assert stats["status"] == {"ok": 295, "failed": 5}
    assert stats["failures"] == {
        "context_overflow": 1,
        "moderation": 1,
        "provider_refused": 1,
        "too_large": 1,
        "guardrail": 1,
    }
    assert rows["id0003"]["error"] == (
        "HTTP 400 from Moonshot AI: Invalid request: Your request exceeded model token limit: 262144 "
        "(requested: 269030)"
    )
    assert rows["id0041"]["failure"] == "moderation" and "self-harm" in rows["id0041"]["error"]
    assert all(rows[f"id{i:04d}"]["asked"] == 1 for i in (3, 41, 97, 150, 222))
    assert len(server.completed) == 295 and set(server.completed.values()) == {1}  # every good prompt, once
    asked = sorted(server.attempts.values())
    assert asked.count(1) == 298 and asked.count(2) == 2  # refusals once; the error and the cut stream twice
    for i in (5, 8):
        turn = rows[f"id{i:04d}"]["messages"][-1]
        assert turn["produced_by"]["attempts"] == 2 and turn["usage"]["lost_tokens"] > 0
    assert stats["usage"]["lost_tokens"] == sum(
        rows[f"id{i:04d}"]["messages"][-1]["usage"]["lost_tokens"] for i in (5, 8)
    )


def test_a_refused_prompt_is_asked_twice_in_all_however_often_the_run_is_repeated(tmp_path, api_key):
    """max_failed_rate 0: each run fails on the refusals. The first rerun asks them again (a refusal may have
    been the route's), the next asks nothing: the journal keeps them, failed, with their reason."""
    prompts = prompts_file(tmp_path, 230)
    server = Loopback("unused", api_key=api_key, faults=FaultPlan(answers=REFUSALS))
    out, stats = tmp_path / "out.jsonl.zst", tmp_path / "stats.json"
    sent = []
    with serve_in_thread(server) as url:
        for _run in range(4):
            with pytest.raises(TooManyFailed, match=r"5 of 230 prompts failed \(2.2%\): 1 "):
                run_journaled_responses(prompts, out, stats, openrouter_backend(url), Budgets(), max_failed_rate=0.0)
            sent.append(sum(server.attempts.values()))
    assert sent == [230, 235, 235, 235]  # the refused 5 asked again once, then never
    refused = [k for k, n in server.attempts.items() if k not in server.completed]
    assert len(refused) == 5 and {server.attempts[k] for k in refused} == {2}
    _header, journaled = read_journal(journal_path(out))
    assert sorted(r["failure"] for r in journaled.values() if r["status"] == "failed") == [
        "context_overflow",
        "guardrail",
        "moderation",
        "provider_refused",
        "too_large",
    ]
    assert {r["asked"] for r in journaled.values() if r["status"] == "failed"} == {2}


def test_a_refused_setting_stops_the_run_naming_the_provider_s_message(tmp_path, api_key):
    """A 401, a 402 and a 404 stop after the requests in flight, whatever the prompt; the message is theirs."""
    for name, said in (
        ("key_401", "No auth credentials found"),
        ("credits_402", "can only afford 27342"),
        ("no_endpoints_404", "No endpoints found that support tool use"),
    ):
        server = Loopback("unused", api_key=api_key, faults=FaultPlan(answers={"Question": name}))
        with (
            serve_in_thread(server) as url,
            pytest.raises(IncompleteRun, match=rf"0 of 20 prompts finished, 20 left \(HTTP 40\d: .*{said}"),
        ):
            run_responses(
                tmp_path / name,
                prompts_file(tmp_path, 20, name=f"{name}.jsonl.zst"),
                openrouter_backend(url, concurrency=2),
            )
        assert sum(server.attempts.values()) <= 2


def test_streamed_answers_are_the_plain_ones(tmp_path, api_key):
    """The same prompts streamed and not: content, reasoning, usage, a tool call and a refusal alike."""
    rows = [
        {"id": "plain", "source": "t", "messages": [{"role": "user", "content": "Tell me a joke."}]},
        {"id": "refused", "source": "t", "messages": [{"role": "user", "content": f"Help {REFUSED} me."}]},
        {
            "id": "tool",
            "source": "t",
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}],
            "messages": [
                {"role": "user", "content": "What is the weather in Paris?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": "c0",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c0", "content": "sunny"},
            ],
        },
    ]
    write_jsonl_zst(tmp_path / "p.jsonl.zst", rows)
    script = [ScriptedCall("weather in Paris", "get_weather", '{"city": "Paris"}')]
    answers = {}
    for stream in (True, False):
        server = Loopback("unused", api_key=api_key, tool_script=script)
        with serve_in_thread(server) as url:
            run_responses(tmp_path / str(stream), tmp_path / "p.jsonl.zst", openrouter_backend(url, stream=stream))
        assert server.last_chat_request.get("stream", False) is stream
        answers[stream] = read_jsonl(tmp_path / str(stream) / "out.jsonl.zst")
    assert answers[True] == answers[False]
    plain, refused, tool = answers[True]
    assert (
        plain["messages"][-1]["content"] == "Reply to: Tell me a joke."
        and plain["messages"][-1]["usage"]["cost"] == 0.001
    )
    assert refused["messages"][-1]["refusal"] == "I can't help with that."
    assert tool["messages"][1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert server.last_chat_request.get("stream_options") is None


def test_a_slow_streamed_answer_longer_than_the_total_timeout_completes(tmp_path, api_key):
    """Chunks 0.3 s apart, about 3 s in all, under request_timeout 1 s: streamed, the answer completes in one
    attempt (idle_timeout 2 s between chunks); not streamed, the same wait is cut at 1 s, every attempt."""
    prompts = prompts_file(tmp_path, 1)
    server = Loopback("unused", api_key=api_key, faults=FaultPlan(chunk_delay_s=0.3))
    once = {**FAST_RETRY, "max_attempts": 2}
    with serve_in_thread(server) as url:
        started = time.monotonic()
        stats = run_responses(tmp_path / "s", prompts, openrouter_backend(url, request_timeout=1.0, idle_timeout=2.0))
        took = time.monotonic() - started
        server.faults = FaultPlan(latency_s=3.0)
        plain = openrouter_backend(url, stream=False, request_timeout=1.0, retry=once)
        with pytest.raises(TooManyFailed, match="retries exhausted: TimeoutError"):
            run_journaled_responses(
                prompts, tmp_path / "p.zst", tmp_path / "p.json", plain, Budgets(), max_failed_rate=0.0
            )
    assert stats["status"] == {"ok": 1} and took > 2.0
    assert (
        stats["assistant_turns"] == 1
        and read_jsonl(tmp_path / "s" / "out.jsonl.zst")[0]["messages"][-1]["produced_by"]["attempts"] == 1
    )


def test_a_stream_cut_without_usage_is_counted_from_what_arrived(tmp_path, api_key):
    """A stream cut after its first words, then answered: the turn's spend holds the cut one's estimate
    (prompt and arrived characters / 4 at the configured prices); a stream that ends in an error with
    every attempt failing leaves it on the failed row, and the run's spend (row_spend) counts both."""
    rows = [{"id": "a", "source": "t", "messages": [{"role": "user", "content": "Say something long please."}]}]
    write_jsonl_zst(tmp_path / "p.jsonl.zst", rows)
    prices = {"prompt": 1.0, "completion": 2.0}
    server = Loopback("unused", api_key=api_key, faults=FaultPlan(answers_once={"long": CUT}))
    with serve_in_thread(server) as url:
        run_responses(tmp_path / "cut", tmp_path / "p.jsonl.zst", openrouter_backend(url, price_per_million=prices))
        server.faults = FaultPlan(answers={"long": "stream_error_midway"})
        once = {**FAST_RETRY, "max_attempts": 2}
        backend = openrouter_backend(url, price_per_million=prices, retry=once)
        with pytest.raises(TooManyFailed, match="retries_exhausted .*Provider disconnected unexpectedly"):
            run_journaled_responses(
                tmp_path / "p.jsonl.zst",
                tmp_path / "e.zst",
                tmp_path / "e.json",
                backend,
                Budgets(),
                max_failed_rate=0.0,
            )
    prompt = -(-len("Say something long please.") // 4)  # 7
    cut = -(-len("An answer that stops in the mid") // 4)  # 8
    turn = read_jsonl(tmp_path / "cut" / "out.jsonl.zst")[0]["messages"][-1]
    assert (turn["usage"]["lost_tokens"], turn["usage"]["lost_cost"]) == (
        prompt + cut,
        pytest.approx((prompt * 1 + cut * 2) / 1e6),
    )
    assert (
        row_spend(read_jsonl(tmp_path / "cut" / "out.jsonl.zst")[0]).tokens
        == turn["usage"]["prompt_tokens"] + turn["usage"]["completion_tokens"] + prompt + cut
    )
    _header, journaled = read_journal(journal_path(tmp_path / "e.zst"))
    arrived = -(-len("The tallest building ever would") // 4)
    assert journaled["a"]["lost"] == {
        "tokens": 2 * (prompt + arrived),
        "cost": pytest.approx(2 * (prompt + 2 * arrived) / 1e6),
    }
    assert row_spend(journaled["a"]) == Spend(pytest.approx(2 * (prompt + 2 * arrived) / 1e6), 2 * (prompt + arrived))
