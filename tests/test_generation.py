"""The SGLang and OpenRouter backends against the loopback server, faults included."""

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3_datagen.backends.base import MissingApiKey, ServerError
from eagle3_datagen.backends.openrouter import OpenRouterBackend
from eagle3_datagen.backends.sglang.generate import SGLangBackend
from eagle3_datagen.backends.sglang.server import launched_server
from eagle3_datagen.chat.template import TemplateError, load_tokenizer
from eagle3_datagen.chat.tiktoken_fast import fast_tokenizer_from_tiktoken
from eagle3_datagen.chat.tool_calls import ToolCallMarkers, derive_markers, openai_call
from eagle3_datagen.formats.files import read_jsonl, write_jsonl_zst
from eagle3_datagen.formats.journal import journal_path
from eagle3_datagen.progress import Progress
from eagle3_datagen.stages.responses.journaled import Budgets, IncompleteRun, run_journaled_responses
from tests.doubles.loopback import FaultPlan, Loopback, ScriptedCall, serve_in_thread

from .conftest import defaults, free_port

REPO = Path(__file__).resolve().parents[1]
KEY_ENV = "E3DG_TEST_OPENROUTER_KEY"
FAST_RETRY = defaults("inference.sglang.retry", initial_backoff=0.01, max_backoff=0.05)
SAMPLING = defaults("inference.sampling", max_new_tokens=64, temperature=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, qwen_tokenizer):
    path = tmp_path_factory.mktemp("served") / "Tiny-Model"
    qwen_tokenizer.save_pretrained(path)
    return path


def prompts_file(tmp_path, n, turns=1, name="prompts.jsonl.zst"):
    rows = []
    for i in range(n):
        messages = [{"role": "system", "content": "Be brief."}]
        for t in range(turns):
            messages.append({"role": "user", "content": f"Question {i}.{t} about topic {i * 7 % 11}"})
        rows.append({"id": f"id{i:04d}", "source": "test", "messages": messages})
    path = tmp_path / name
    write_jsonl_zst(path, rows)
    return path


def openrouter(url, **settings):
    return OpenRouterBackend(
        SAMPLING,
        defaults(
            "inference.openrouter",
            base_url=url,
            model="moonshotai/kimi-k2.5",
            api_key_env=KEY_ENV,
            retry=FAST_RETRY,
            **settings,
        ),
    )


@pytest.fixture
def api_key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "test-key-123")
    return "test-key-123"


def run(tmp_path, prompts, backend, budgets=None):
    return run_journaled_responses(
        prompts, tmp_path / "out.jsonl.zst", tmp_path / "stats.json", backend, budgets or Budgets()
    )


def test_openrouter_retries_every_transient_error_and_records_each_turn(tmp_path, api_key):
    faults = FaultPlan(every=2, sequence=[429, 503, "200-error", "200-empty", 500, 408], retry_after=0)
    server = Loopback("unused", api_key=api_key, faults=faults)
    prompts = prompts_file(tmp_path, 24, turns=2)
    with serve_in_thread(server) as url:
        routing = {"order": ["moonshotai"], "allow_fallbacks": False, "quantizations": ["int4"]}
        stats = run(tmp_path, prompts, openrouter(url, concurrency=8, provider=routing))
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
    assert not journal_path(tmp_path / "out.jsonl.zst").exists()
    sent = server.last_chat_request
    assert sent["provider"] == {"order": ["moonshotai"], "allow_fallbacks": False, "quantizations": ["int4"]}
    assert (
        sent["reasoning"] == {"enabled": True} and sent["max_tokens"] == 64 and sent["model"] == "moonshotai/kimi-k2.5"
    )


def test_retry_after_is_honoured(tmp_path, api_key):
    server = Loopback("unused", api_key=api_key, faults=FaultPlan(every=1, sequence=[429], retry_after=1))
    with serve_in_thread(server) as url:
        start = time.monotonic()
        run(tmp_path, prompts_file(tmp_path, 1), openrouter(url))
        assert time.monotonic() - start >= 1.0


def test_bad_requests_are_recorded_not_retried(tmp_path, api_key):
    server = Loopback("unused", api_key=api_key, faults=FaultPlan(reject=["Question 3.0"]))
    with serve_in_thread(server) as url:
        stats = run(tmp_path, prompts_file(tmp_path, 6), openrouter(url))
    assert stats["status"] == {"ok": 5, "failed": 1}
    assert stats["failed"] == {"id0003": "HTTP 400: 400 invalid request"}
    assert server.status_counts["400"] == 1


def test_out_of_credits_stops_cleanly_and_a_rerun_continues(tmp_path, api_key):
    prompts = prompts_file(tmp_path, 10)
    out_of_credits = pytest.raises(IncompleteRun, match=r"4 of 10 prompts finished, 6 left .*out of credits")
    with serve_in_thread(Loopback("unused", api_key=api_key, faults=FaultPlan(credits=4))) as url, out_of_credits:
        run(tmp_path, prompts, openrouter(url, concurrency=1))
    assert not (tmp_path / "out.jsonl.zst").exists()
    journaled = [
        json.loads(line)["id"] for line in journal_path(tmp_path / "out.jsonl.zst").read_text().splitlines()[1:]
    ]
    assert len(journaled) == 4
    fresh = Loopback("unused", api_key=api_key)
    with serve_in_thread(fresh) as url:
        stats = run(tmp_path, prompts, openrouter(url, concurrency=1))
    assert stats["status"] == {"ok": 10} and sum(fresh.completed.values()) == 6
    assert [r["id"] for r in read_jsonl(tmp_path / "out.jsonl.zst")] == [f"id{i:04d}" for i in range(10)]


def test_402_with_retry_after_is_retried(tmp_path, api_key):
    server = Loopback("unused", api_key=api_key, faults=FaultPlan(every=1, sequence=[402], retry_after=0))
    with serve_in_thread(server) as url:
        stats = run(tmp_path, prompts_file(tmp_path, 3), openrouter(url))
    assert stats["status"] == {"ok": 3} and server.status_counts["402"] == 3


def test_budgets_stop_new_conversations_and_leave_a_resumable_state(tmp_path, api_key):
    prompts = prompts_file(tmp_path, 10)
    with serve_in_thread(Loopback("unused", api_key=api_key)) as url:
        with pytest.raises(IncompleteRun, match=r"max_cost_usd=0.003 reached"):
            run(tmp_path, prompts, openrouter(url, concurrency=1), Budgets(cost_usd=0.003))
        with pytest.raises(IncompleteRun, match=r"token_budget=40 reached"):
            run(tmp_path, prompts, openrouter(url, concurrency=1), Budgets(tokens=40))
        stats = run(tmp_path, prompts, openrouter(url, concurrency=1), Budgets(tokens=10_000))
    assert stats["prompts"] == 10


def test_missing_key_fails_before_any_request(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(MissingApiKey, match=f"{KEY_ENV} is not set"):
        openrouter("http://127.0.0.1:9")


def test_wrong_key_stops_the_run(tmp_path, api_key, monkeypatch):
    invalid = pytest.raises(IncompleteRun, match="API key is missing or invalid")
    with serve_in_thread(Loopback("unused", api_key="another-key")) as url, invalid:
        run(tmp_path, prompts_file(tmp_path, 3), openrouter(url))


def sglang(model_dir, url, **settings):
    return SGLangBackend(
        model_dir, SAMPLING, defaults("inference.sglang", url=url, retry=FAST_RETRY, **settings), defaults("model")
    )


def test_sglang_returns_exact_ids_through_two_tiers(tmp_path, model_dir):
    server = Loopback(
        str(model_dir),
        tokenizer=load_tokenizer(model_dir),
        faults=FaultPlan(every=3, sequence=[503, 500], retry_after=0),
    )
    tiers = {
        "short": {"max_prompt_tokens": 40, "concurrency": 4, "max_tokens": 64},
        "long": {"concurrency": 2, "max_tokens": 3},
    }
    with serve_in_thread(server) as url:
        stats = run(tmp_path, prompts_file(tmp_path, 12, turns=2), sglang(model_dir, url, tiers=tiers))
    rows = read_jsonl(tmp_path / "out.jsonl.zst")
    turns = [m for r in rows for m in r["messages"] if m["role"] == "assistant"]
    short = [t for t in turns if t["produced_by"]["tier"] == "short"]
    long = [t for t in turns if t["produced_by"]["tier"] == "long"]
    assert short and long
    assert all(t["output_ids"][-1] == 151645 and t["finish_reason"] == "stop" for t in short)
    assert all(len(t["output_ids"]) == 3 and t["finish_reason"] == "length" for t in long)  # the long tier's cap
    assert all(t["content"].startswith("Answer ") for t in short)
    assert stats["status"]["truncated"] == len({r["id"] for r in rows if r["status"] == "truncated"})


def test_sglang_refuses_a_server_with_another_model(tmp_path, model_dir):
    mismatch = pytest.raises(ServerError, match="serves '/models/Other-Model', not the configured model 'Tiny-Model'")
    with serve_in_thread(Loopback("/models/Other-Model")) as url, mismatch:
        run(tmp_path, prompts_file(tmp_path, 1), sglang(model_dir, url))


def test_launched_server_is_healthy_during_the_job_and_stopped_after(tmp_path, model_dir):
    port = free_port()
    launch = defaults(
        "inference.sglang.launch",
        command=[sys.executable, "-m", "tests.doubles.loopback"],
        args=["--tp", "8"],
        health_timeout=120,
    )
    url = f"http://127.0.0.1:{port}"
    with launched_server(model_dir, url, launch, tmp_path / "server.log") as process:
        stats = run(tmp_path, prompts_file(tmp_path, 3), sglang(model_dir, url))
        assert process.poll() is None
    assert stats["status"] == {"ok": 3}
    assert process.poll() is not None


def test_kill_9_then_rerun_loses_and_repeats_nothing(tmp_path, model_dir, api_key):
    prompts = prompts_file(tmp_path, 40)
    server = Loopback("unused", api_key=api_key, faults=FaultPlan(latency_s=0.05))
    settings = {
        "backend": "openrouter",
        "sampling": SAMPLING,
        "openrouter": defaults("inference.openrouter", base_url=None, model="m", api_key_env=KEY_ENV, concurrency=2),
        "model": defaults("model", path=str(model_dir)),
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
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (not journal.exists() or journal.read_text().count("\n") < 8):
            time.sleep(0.05)
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


def test_sigterm_stops_a_launched_server(tmp_path, model_dir):
    port = free_port()
    job = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from eagle3_datagen.backends.sglang.server import launched_server\n"
            "from eagle3_datagen.config_schema import fill_defaults\n"
            "launch = {'command': [sys.executable, '-m', 'tests.doubles.loopback'], 'health_timeout': 120}\n"
            "launch = fill_defaults(launch, 'inference.sglang.launch')\n"
            f"with launched_server({str(model_dir)!r}, 'http://127.0.0.1:{port}', launch, {str(tmp_path / 's.log')!r})"
            " as p:\n"
            "    print(p.pid, flush=True)\n"
            "    time.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    server_pid = int(job.stdout.readline())
    os.kill(server_pid, 0)  # running
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=60) != 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(server_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the server outlived the job")


def test_progress_in_a_log_file_is_plain_lines(caplog):
    logger = logging.getLogger("test.progress")
    progress = Progress(3, "prompts", logger, interval=0.0)
    with caplog.at_level("INFO", logger="test.progress"):
        for i in range(3):
            progress.advance(tokens=15, failed=i == 1, cost=0.5)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and lines[-1].startswith("progress: 3/3 prompts, ")
    assert "tokens/s, 1 failed, $1.5000, ETA 0 s" in lines[-1]
    assert not any("\r" in line for line in lines)


# Tool calls, regenerated natively, on Kimi-K2.5's real tokenizer and template.

FACTORIAL = {
    "type": "function",
    "function": {
        "name": "calculate_factorial",
        "description": "Calculate the factorial of a number",
        "parameters": {"type": "object", "properties": {"number": {"type": "integer"}}, "required": ["number"]},
    },
}


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    """Kimi-K2.5's real tokenizer (fast, built from its tiktoken.model) and template, as a model directory."""
    path = tmp_path_factory.mktemp("kimi") / "Kimi-K2.5"
    fast_tokenizer_from_tiktoken(REPO / "resources" / "kimi-k2.5").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def kimi_tokenizer(kimi_dir):
    return load_tokenizer(kimi_dir)


def recorded_call(name, arguments, index, result=None):
    """A prompt's recorded tool-call turn, and its recorded result when given."""
    call = openai_call(name, arguments, index)
    messages = [{"role": "assistant", "content": "", "tool_calls": [call]}]
    if result is not None:
        messages.append({"role": "tool", "tool_call_id": call["id"], "name": name, "content": result})
    return messages


def tool_prompts(tmp_path):
    user = {"role": "user", "content": "Factorial of 5?"}
    rows = [
        # the model's call equals the recorded one as JSON (the spacing differs): its result is reused
        [
            user,
            *recorded_call("calculate_factorial", '{"number":5}', 0, '{"result": 120}'),
            {"role": "user", "content": "Thanks"},
        ],
        [
            {"role": "user", "content": "Factorial of 6?"},
            *recorded_call("calculate_factorial", '{"number":6}', 0, "720"),
        ],
        [user, *recorded_call("calculate_factorial", '{"number":5}', 0)],  # no recorded result
        [{"role": "user", "content": "Factorial of 8, quickly"}],  # the record answered without a call
        [{"role": "user", "content": "Hello there"}],
    ]
    prompts = [
        {"id": f"t{i}", "source": "test", "messages": m, **({"tools": [FACTORIAL]} if i < 4 else {})}
        for i, m in enumerate(rows)
    ]
    path = tmp_path / "tools.jsonl.zst"
    write_jsonl_zst(path, prompts)
    return path


TOOL_SCRIPT = [
    ScriptedCall("Factorial of 5", "calculate_factorial", '{"number": 5}'),
    ScriptedCall("Factorial of 6", "calculate_factorial", '{"number": 7}'),
    ScriptedCall("Factorial of 8", "calculate_factorial", '{"number": 8}'),
]


def test_kimi_tool_call_markers_come_from_the_template_and_parse_like_sglang(kimi_tokenizer):
    markers = derive_markers(kimi_tokenizer)
    assert markers == ToolCallMarkers(
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
    )
    # each marker is one token of the real vocabulary, not a special one
    for marker, token_id in zip(vars(markers).values(), (163595, 163596, 163597, 163598, 163599), strict=True):
        assert kimi_tokenizer(marker, add_special_tokens=False)["input_ids"] == [token_id]
        assert not kimi_tokenizer.added_tokens_decoder[token_id].special
    output = (
        "Let me check. <|tool_calls_section_begin|><|tool_call_begin|> functions.calculate_factorial:7 "
        '<|tool_call_argument_begin|>{"number": 5}<|tool_call_end|><|tool_call_begin|>lookup:0'
        '<|tool_call_argument_begin|>{"q": "x"}<|tool_call_end|><|tool_calls_section_end|>'
    )
    content, calls = markers.split(output, [FACTORIAL], first_index=2)
    assert content == "Let me check. "
    # SGLang numbers calls after the history's, whatever index the model wrote
    assert calls == [
        openai_call("calculate_factorial", '{"number": 5}', 2),
        openai_call("lookup", '{"q": "x"}', 3),
    ]
    bare = "<|tool_calls_section_begin|><|tool_call_begin|>0<|tool_call_argument_begin|>{}<|tool_call_end|>"
    assert markers.split(bare, [FACTORIAL], 0)[1] == [openai_call("calculate_factorial", "{}", 0)]
    assert markers.split("<|tool_calls_section_begin|>oops", [FACTORIAL], 0) == ("<|tool_calls_section_begin|>oops", [])
    assert markers.split("No calls.", [FACTORIAL], 0) == ("No calls.", None)
    assert markers.render([("f", "{}")], 4) == (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:4<|tool_call_argument_begin|>{}"
        "<|tool_call_end|><|tool_calls_section_end|>"
    )


def test_a_template_without_kimi_style_calls_refuses_prompts_with_tools(model_dir, qwen_tokenizer):
    from eagle3_datagen.backends.rendered import ToolCallReader

    reader = ToolCallReader(qwen_tokenizer, {})
    reader.check(None)  # prompts without tools are served as before
    with pytest.raises(TemplateError, match="declares tools, but the chat template does not write a tool call"):
        reader.check([FACTORIAL])


def test_sglang_tool_chain_reuses_matching_results_and_ends_where_calls_differ(tmp_path, kimi_dir, kimi_tokenizer):
    server = Loopback(str(kimi_dir), tokenizer=kimi_tokenizer, tool_script=TOOL_SCRIPT)
    with serve_in_thread(server) as url:
        stats = run(tmp_path, tool_prompts(tmp_path), sglang(kimi_dir, url))
    matched, diverged, missing, unrecorded, plain = read_jsonl(tmp_path / "out.jsonl.zst")

    call = openai_call("calculate_factorial", '{"number": 5}', 0)
    assert [m["role"] for m in matched["messages"]] == ["user", "assistant", "tool", "assistant", "user", "assistant"]
    called, result, answer = matched["messages"][1:4]
    assert called["tool_calls"] == [call] and called["finish_reason"] == "tool_calls"
    assert called["content"] == "" and called["reasoning"] == "Considering it."
    assert kimi_tokenizer.decode(called["output_ids"]) == (
        "Considering it.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.calculate_factorial:0"
        '<|tool_call_argument_begin|>{"number": 5}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
    )
    assert result == {
        "role": "tool",
        "tool_call_id": "functions.calculate_factorial:0",
        "name": "calculate_factorial",
        "content": '{"result": 120}',
    }
    assert answer["finish_reason"] == "stop" and answer["content"].startswith("Answer ") and "tool_calls" not in answer
    assert [m["turn"] for m in matched["messages"] if m["role"] == "assistant"] == [0, 1, 2]
    assert matched["status"] == "ok" and "ended" not in matched and matched["tools"] == [FACTORIAL]

    # the model saw the tools declared, its own call and the reused result, rendered by K2.5's template
    after_result = next(p for p in server.generate_prompts if "## Return of" in p and "Factorial of 5" in p)
    assert after_result.startswith(
        '<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":"calculate_factorial"'
    )
    assert after_result.endswith(
        # the reasoning of the call turn stays in the chain, as K2.5's template keeps it
        "<|im_assistant|>assistant<|im_middle|><think>Considering it.</think><|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.calculate_factorial:0<|tool_call_argument_begin|>{"number": 5}'
        "<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
        "<|im_system|>calculate_factorial<|im_middle|>## Return of functions.calculate_factorial:0\n"
        '{"result": 120}<|im_end|><|im_assistant|>assistant<|im_middle|><think>'
    )

    for row, ended in (
        (diverged, "tool_call_diverged"),
        (missing, "tool_result_missing"),
        (unrecorded, "tool_call_unrecorded"),
    ):
        assert row["status"] == "ok" and row["ended"] == ended
        assert row["messages"][-1]["role"] == "assistant" and row["messages"][-1]["finish_reason"] == "tool_calls"
    assert diverged["messages"][-1]["tool_calls"] == [openai_call("calculate_factorial", '{"number": 7}', 0)]
    assert "tools" not in plain and "tool_call_counts" not in plain and plain["messages"][-1]["finish_reason"] == "stop"
    assert not any("tool_declare" in p for p in server.generate_prompts if "Hello there" in p)

    assert stats["tool_calls"] == {
        "regenerated": 4,
        "matched": 2,
        "diverged": 2,
        "results_reused": 1,
        "recorded_not_called": 0,
    }
    assert stats["ended"] == {"tool_call_diverged": 1, "tool_result_missing": 1, "tool_call_unrecorded": 1}
    assert stats["finish_reasons"] == {"tool_calls": 4, "stop": 3}


def test_openrouter_declares_tools_and_stores_its_calls_with_kimi_ids(tmp_path, api_key):
    server = Loopback("unused", api_key=api_key, tool_script=TOOL_SCRIPT)
    prompts = tmp_path / "p.jsonl.zst"
    user = {"role": "user", "content": "Factorial of 5?"}
    history = [{"role": "user", "content": "Warm-up"}, *recorded_call("noop", "{}", 0, "ok")]
    messages = [*history, user, *recorded_call("calculate_factorial", '{"number": 5}', 1, "120")]
    write_jsonl_zst(prompts, [{"id": "o1", "source": "test", "tools": [FACTORIAL], "messages": messages}])
    with serve_in_thread(server) as url:
        stats = run(tmp_path, prompts, openrouter(url))
    [row] = read_jsonl(tmp_path / "out.jsonl.zst")
    # the warm-up turn answers in text: its recorded call is counted as not made
    assert [m["role"] for m in row["messages"]] == ["user", "assistant", "user", "assistant", "tool", "assistant"]
    called = row["messages"][3]
    # the provider's "call_..." id is replaced by Kimi's, numbered after the history's calls
    assert called["tool_calls"] == [openai_call("calculate_factorial", '{"number": 5}', 0)]
    assert called["finish_reason"] == "tool_calls" and called["content"] == ""
    assert row["messages"][4]["tool_call_id"] == "functions.calculate_factorial:0"
    sent = server.last_chat_request
    assert sent["tools"] == [FACTORIAL]
    assert sent["messages"][-2:] == [
        {"role": "assistant", "content": "", "tool_calls": [openai_call("calculate_factorial", '{"number": 5}', 0)]},
        {
            "role": "tool",
            "content": "120",
            "tool_call_id": "functions.calculate_factorial:0",
            "name": "calculate_factorial",
        },
    ]
    assert stats["tool_calls"]["recorded_not_called"] == 1 and stats["tool_calls"]["results_reused"] == 1


def test_hf_backend_declares_tools_and_goes_on_after_a_matched_call(tmp_path, kimi_dir, kimi_tokenizer):
    """The hf backend on Kimi-K2.5's tokenizer and template, with a tiny random Qwen3 as the model.

    A random model cannot be made to call a tool, so `lm.generate` is replaced by one that
    answers the rendered prompt with fixed output IDs (a call after a user turn, a text answer
    after a tool result). The rendering with tools, the output parsing and the loop are real.
    """
    import shutil

    import torch

    from eagle3_datagen.backends.hf.generate import HFBackend

    from .conftest import tiny_qwen3

    model_dir = tmp_path / "Kimi-tiny"
    shutil.copytree(kimi_dir, model_dir)
    torch.manual_seed(0)
    tiny_qwen3(len(kimi_tokenizer), num_layers=1).save_pretrained(model_dir)
    backend = HFBackend(
        model_dir,
        defaults("inference.sampling", max_new_tokens=64),
        defaults("inference.hf", batch_size=2),
        defaults("model"),
    )
    markers = derive_markers(kimi_tokenizer)
    seen = []

    def scripted_generate(input_ids, attention_mask, **kwargs):
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
            prompt = kimi_tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
            seen.append(prompt)
            if "## Return of" in prompt.rsplit("<|im_user|>", 1)[-1]:
                text = "Got it.</think>It is 120.<|im_end|>"
            else:
                text = "Compute it.</think>" + markers.render([("calculate_factorial", '{"number": 5}')]) + "<|im_end|>"
            rows.append(ids + kimi_tokenizer(text, add_special_tokens=False)["input_ids"])
        width = max(map(len, rows))
        return torch.tensor([r + [kimi_tokenizer.pad_token_id] * (width - len(r)) for r in rows])

    backend.lm.generate = scripted_generate
    prompt = {
        "id": "h1",
        "source": "test",
        "tools": [FACTORIAL],
        "messages": [
            {"role": "user", "content": "Factorial of 5?"},
            *recorded_call("calculate_factorial", '{"number":5}', 0, "120"),
        ],
    }
    write_jsonl_zst(tmp_path / "h.jsonl.zst", [prompt])
    run(tmp_path, tmp_path / "h.jsonl.zst", backend)
    [row] = read_jsonl(tmp_path / "out.jsonl.zst")
    assert [m["role"] for m in row["messages"]] == ["user", "assistant", "tool", "assistant"]
    called, result, answer = row["messages"][1:]
    assert called["tool_calls"] == [openai_call("calculate_factorial", '{"number": 5}', 0)]
    assert called["finish_reason"] == "tool_calls" and called["reasoning"] == "Compute it."
    assert result["tool_call_id"] == "functions.calculate_factorial:0" and result["content"] == "120"
    assert (answer["reasoning"], answer["content"], answer["finish_reason"]) == ("Got it.", "It is 120.", "stop")
    assert all(p.startswith("<|im_system|>tool_declare<|im_middle|>") for p in seen) and len(seen) == 2
    assert row["tool_call_counts"] == {"regenerated": 1, "matched": 1, "results_reused": 1}


def test_a_glaive_record_is_regenerated_with_its_recorded_results(tmp_path, kimi_dir, kimi_tokenizer):
    from eagle3_datagen.stages.prompts import build_prompts

    from .test_prompts import GLAIVE_CHAIN, write_jsonl

    prompts = tmp_path / "prompts.jsonl.zst"
    build_prompts(write_jsonl(tmp_path / "glaive.jsonl", [GLAIVE_CHAIN]), "glaive", [prompts], tmp_path / "p.json")
    script = [
        ScriptedCall("factorial of 5", "calculate_factorial", '{"number": 5}'),
        ScriptedCall("news for the United States", "get_news_headlines", '{"country": "United States"}'),
    ]
    with serve_in_thread(Loopback(str(kimi_dir), tokenizer=kimi_tokenizer, tool_script=script)) as url:
        stats = run(tmp_path, prompts, sglang(kimi_dir, url))
    [row] = read_jsonl(tmp_path / "out.jsonl.zst")
    assert [m["role"] for m in row["messages"]] == [
        *("system", "user", "assistant", "tool", "assistant"),
        *("user", "assistant", "tool", "assistant"),
        *("user", "assistant"),
    ]
    calls = [m["tool_calls"][0] for m in row["messages"] if m.get("tool_calls")]
    assert [c["id"] for c in calls] == ["functions.calculate_factorial:0", "functions.get_news_headlines:1"]
    results = [(m["tool_call_id"], m["content"]) for m in row["messages"] if m["role"] == "tool"]
    assert results == [
        ("functions.calculate_factorial:0", '{"result": 120}'),
        ("functions.get_news_headlines:1", '{"headlines": ["A", "B"]}'),
    ]
    assert row["status"] == "ok" and "ended" not in row and len(row["tools"]) == 2
    assert stats["tool_calls"] == {
        "regenerated": 2,
        "matched": 2,
        "diverged": 0,
        "results_reused": 2,
        "recorded_not_called": 0,
    }


def test_calls_match_by_function_and_arguments_as_json_values():
    from eagle3_datagen.chat.tool_calls import same_call

    recorded = openai_call("f", '{"b":[1,true],"a":5}', 3)
    assert same_call(openai_call("f", '{"a": 5.0, "b": [1, true]}', 0), recorded)  # order, spacing, 5 == 5.0
    assert not same_call(openai_call("f", '{"a": 5, "b": [1, 1]}', 0), recorded)  # true is not 1
    assert not same_call(openai_call("g", '{"b":[1,true],"a":5}', 0), recorded)
    assert not same_call(openai_call("f", "{not json", 0), openai_call("f", "{not json", 0))
