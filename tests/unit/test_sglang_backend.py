"""The SGLang backend against the loopback server: tiers, exact output IDs, the served model's check,
and the server a job launches itself (up during the job, stopped after it and on SIGTERM)."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from eagle3_datagen.backends.base import ServerError, ServerGone
from eagle3_datagen.backends.service.record import pid_alive
from eagle3_datagen.backends.sglang.generate import SGLangBackend
from eagle3_datagen.backends.sglang.server import launched_server
from eagle3_datagen.chat.template import load_tokenizer
from eagle3_datagen.formats.files import read_jsonl
from tests.doubles.loopback import FaultPlan, Loopback, serve_in_thread
from tests.helpers import SAMPLING, defaults, free_port, prompts_file, run_responses, sglang_backend, wait_until


def test_sglang_returns_exact_ids_through_two_tiers(tmp_path, qwen_tokenizer_dir):
    server = Loopback(
        str(qwen_tokenizer_dir),
        tokenizer=load_tokenizer(qwen_tokenizer_dir),
        faults=FaultPlan(every=3, sequence=[503, 500], retry_after=0),
    )
    tiers = {
        "short": {"max_prompt_tokens": 40, "concurrency": 4, "max_tokens": 64},
        "long": {"concurrency": 2, "max_tokens": 3},
    }
    with serve_in_thread(server) as url:
        backend = sglang_backend(qwen_tokenizer_dir, url, tiers=tiers)
        stats = run_responses(tmp_path, prompts_file(tmp_path, 12, turns=2), backend)
    rows = read_jsonl(tmp_path / "out.jsonl.zst")
    turns = [m for r in rows for m in r["messages"] if m["role"] == "assistant"]
    short = [t for t in turns if t["produced_by"]["tier"] == "short"]
    long = [t for t in turns if t["produced_by"]["tier"] == "long"]
    assert short and long
    assert all(t["output_ids"][-1] == 151645 and t["finish_reason"] == "stop" for t in short)
    assert all(len(t["output_ids"]) == 3 and t["finish_reason"] == "length" for t in long)  # the long tier's cap
    assert all(t["content"].startswith("Answer ") for t in short)
    assert stats["status"]["truncated"] == len({r["id"] for r in rows if r["status"] == "truncated"})


def test_a_raised_tier_limit_asks_again_only_for_the_answers_cut_at_the_old_one(tmp_path, qwen_tokenizer_dir):
    """The long tier capped at 3 tokens cuts its answers; with its cap raised, the rerun (the output deleted,
    as Snakemake deletes it) asks only for the prompts it cut, and keeps the others' rows as they were."""
    server = Loopback(str(qwen_tokenizer_dir), tokenizer=load_tokenizer(qwen_tokenizer_dir))
    prompts, out = prompts_file(tmp_path, 12), tmp_path / "out.jsonl.zst"
    chat = sglang_backend(qwen_tokenizer_dir, "http://unused").chat
    lengths = sorted(len(chat.prompt_ids(p["messages"], None)) for p in read_jsonl(prompts))
    tiers = {  # the longer prompts through the long tier
        "short": {"max_prompt_tokens": lengths[5], "concurrency": 4, "max_tokens": 64},
        "long": {"concurrency": 2, "max_tokens": 3},
    }
    with serve_in_thread(server) as url:
        run_responses(tmp_path, prompts, sglang_backend(qwen_tokenizer_dir, url, tiers=tiers))
        before = {row["id"]: row for row in read_jsonl(out)}
        out.unlink()
        asked = len(server.generate_prompts)
        raised = {**tiers, "long": {"concurrency": 2, "max_tokens": 64}}
        stats = run_responses(tmp_path, prompts, sglang_backend(qwen_tokenizer_dir, url, tiers=raised))
    cut = {i for i, row in before.items() if row["status"] == "truncated"}
    asked_again = {f"id{int(p.split('Question ')[1].split('.')[0]):04d}" for p in server.generate_prompts[asked:]}
    assert 0 < len(cut) < 12 and asked_again == cut
    after = {row["id"]: row for row in read_jsonl(out)}
    assert all(after[i] == before[i] for i in before if i not in cut)
    assert stats["throughput"]["prompts"] == len(cut) and stats["status"] == {"ok": 12}


def test_sglang_refuses_a_server_with_another_model(tmp_path, qwen_tokenizer_dir):
    mismatch = pytest.raises(ServerError, match="serves '/models/Other-Model', not the configured model 'Tiny-Model'")
    with serve_in_thread(Loopback("/models/Other-Model")) as url, mismatch:
        run_responses(tmp_path, prompts_file(tmp_path, 1), sglang_backend(qwen_tokenizer_dir, url))


def test_a_launched_server_that_hangs_and_is_killed_before_its_first_answer_ends_the_wait_at_once(
    tmp_path, qwen_tokenizer_dir
):
    """A server stopped (SIGSTOP) right after its supervisor marked it ready: the kernel accepts the job's
    connections and nothing answers, here a socket nobody reads. Once the supervisor kills it as hung
    (`server_alive` turns false) the job's health wait ends with ServerGone, which the job answers by
    starting the server again, not health_timeout (600 s) later with an error that stops it."""
    hung = socket.create_server(("127.0.0.1", 0))
    killed_at = [float("inf")]  # the supervisor's kill, 2 s after the job starts waiting
    backend = SGLangBackend(
        qwen_tokenizer_dir,
        SAMPLING,
        defaults("inference.sglang", url=f"http://127.0.0.1:{hung.getsockname()[1]}", health_timeout=600),
        defaults("model"),
        server_alive=lambda: time.monotonic() < killed_at[0],
    )

    async def enter():
        async with backend:
            pass

    started = time.monotonic()
    killed_at[0] = started + 2
    with hung, pytest.raises(ServerGone, match="is gone"):
        asyncio.run(enter())
    assert time.monotonic() - started < 15  # one unanswered health check (5 s) after the kill


def test_launched_server_is_healthy_during_the_job_and_stopped_after(tmp_path, qwen_tokenizer_dir):
    port = free_port()
    launch = defaults(
        "inference.sglang.launch",
        command=[sys.executable, "-m", "tests.doubles.loopback"],
        args=["--tp", "8"],
        health_timeout=120,
    )
    url = f"http://127.0.0.1:{port}"
    with launched_server(qwen_tokenizer_dir, url, launch, tmp_path / "server.log") as process:
        stats = run_responses(tmp_path, prompts_file(tmp_path, 3), sglang_backend(qwen_tokenizer_dir, url))
        assert process.poll() is None
    assert stats["status"] == {"ok": 3}
    assert process.poll() is not None


def test_sigterm_stops_a_launched_server(tmp_path, qwen_tokenizer_dir):
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
            f"with launched_server({str(qwen_tokenizer_dir)!r}, 'http://127.0.0.1:{port}', launch,"
            f" {str(tmp_path / 's.log')!r}) as p:\n"
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
    assert wait_until(lambda: not pid_alive(server_pid), timeout=30), "the server outlived the job"


def test_the_journal_fingerprint_is_the_sections_output_settings(qwen_tokenizer_dir):
    """Every output-shaping key of inference.sglang is in the fingerprint (the server's launch args and
    served model name included), no run-only one: a changed timeout or concurrency resumes the journal."""
    launch = {"args": ["--context-length", "4096"], "run_args": ["--tp", "8"]}
    backend = sglang_backend(qwen_tokenizer_dir, "http://a", served_model="kimi", launch=launch)
    own = backend.fingerprint()["sglang"]
    assert own["served_model"] == "kimi" and own["launch"] == {"args": ["--context-length", "4096"]}
    short = own["tiers"]["short"]
    assert "max_prompt_tokens" in short and "concurrency" not in short and "url" not in own
    run_only = sglang_backend(
        qwen_tokenizer_dir,
        "http://b",
        served_model="kimi",
        launch={**launch, "run_args": ["--tp", "4"]},
        request_timeout=5,
        tiers={"short": {"concurrency": 1}, "long": {"concurrency": 1}},
    )
    assert run_only.fingerprint() == backend.fingerprint()
    assert sglang_backend(qwen_tokenizer_dir, "http://a", served_model="other").fingerprint() != backend.fingerprint()


def test_the_nodes_server_starts_without_its_tokenizer_once_whatever_the_users_flags(tmp_path):
    """The launched server is sent input_ids and read for output_ids: its command ends with
    --skip-tokenizer-init after the user's flags, and holds it once where the user's flags have it."""
    from eagle3_datagen.backends.plugins import GENERATION

    def command(args: list[str], run_args: list[str]) -> list[str]:
        launch = defaults("inference.sglang.launch", args=args, run_args=run_args)
        settings = {"sglang": {"url": "http://127.0.0.1:30000", "launch": launch}, "model": {"path": str(tmp_path)}}
        return GENERATION["sglang"].launched_service({**settings, "gpus": 0, "handover": None}, None).command

    plain = command(["--context-length", "4096"], ["--tp", "8"])
    assert plain[-5:] == ["--context-length", "4096", "--tp", "8", "--skip-tokenizer-init"]
    assert command(["--skip-tokenizer-init"], []).count("--skip-tokenizer-init") == 1
    assert command([], ["--skip-tokenizer-init"]).count("--skip-tokenizer-init") == 1
