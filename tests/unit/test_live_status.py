"""The live status (reporting/live.py, scripts/status.py --watch) on a journal written by the real
OpenRouter backend against the loopback server (tests/doubles/loopback.py), stopped by its budget as a
run in progress leaves it, beside a finished shard and one not started."""

import signal
import subprocess
import sys
import time

import pytest
import yaml

from eagle3_datagen.formats.files import read_json, read_jsonl, write_json, write_jsonl_zst
from eagle3_datagen.formats.journal import journal_path, read_journal
from eagle3_datagen.reporting.live import format_progress, model_gates, rates, run_progress
from eagle3_datagen.stages.responses.journaled import Budgets, IncompleteRun, run_journaled_responses
from eagle3_datagen.stages.tokens import run_tokens
from tests.doubles.loopback import FaultPlan, Loopback, serve_in_thread
from tests.helpers import KEY_ENV, REPO, defaults, openrouter_backend, token_settings


def prompts(n: int, shard: int) -> list[dict]:
    """Questions the loopback answers in words: the long ones run past max_tokens (truncated); "forbidden"
    ones are refused with a 400 (failed)."""
    rows = []
    for i in range(n):
        question = f"Q{shard}.{i}" if i % 3 else f"Question {shard}.{i}, about a long topic with many words"
        if i % 5 == 4:
            question += " forbidden"
        rows.append({"id": f"s{shard}p{i:03d}", "source": "test", "messages": [{"role": "user", "content": question}]})
    return rows


# The loopback bills $0.001 an answer; at these prices a request's worst case (max_tokens 8) is $0.0012.
WORST_1_2_MILLS = {"prompt": 0.0, "completion": 150.0}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, qwen_tokenizer_dir):
    """A partition `chat` of three shards: 00000 stopped by its budget (its journal kept), 00001 finished
    (stats, no tokens yet), 00002 not started. The config names the loopback's model directory."""
    work = tmp_path_factory.mktemp("live")
    responses = work / "results/chat/responses"
    responses.mkdir(parents=True)
    shards = [prompts(30, s) for s in range(3)]
    for s, rows in enumerate(shards):
        write_jsonl_zst(work / f"results/chat/prompts/{s:05d}.jsonl.zst", rows)
    write_json(work / "results/chat/prompts/stats.json", {"prompts": 90})
    with pytest.MonkeyPatch.context() as env:
        env.setenv(KEY_ENV, "test-key-123")
        server = Loopback("moonshotai/kimi-k2.5", api_key="test-key-123", faults=FaultPlan(reject=["forbidden"]))
        with serve_in_thread(server) as url:
            for shard, budget in (("00000", Budgets(cost_usd=0.0141, prices=WORST_1_2_MILLS)), ("00001", Budgets())):
                backend = openrouter_backend(url, concurrency=1, max_tokens=8)
                try:
                    run_journaled_responses(
                        work / f"results/chat/prompts/{shard}.jsonl.zst", responses / f"{shard}.jsonl.zst",
                        responses / f"{shard}.stats.json", backend, budget,
                    )  # fmt: skip
                except IncompleteRun:
                    assert shard == "00000"
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    config["model"] = {"path": str(qwen_tokenizer_dir), "trust_remote_code": False}
    chat = {"source": "chats.jsonl", "format": "sharegpt", "shards": 3, "backend": "openrouter"}
    config["partitions"] = {"chat": chat}
    (work / "run.yaml").write_text(yaml.safe_dump(config))
    return work


def test_progress_counts_a_real_journal_a_finished_shard_and_a_pending_one(run_dir):
    fill = defaults("tokens")
    config = {"model": defaults("model", path=str(run_dir / "unused")), "tokens": fill}
    assert model_gates(config)[0] is None  # no tokenizer there: gated rows only where the tokens stage ran
    config = yaml.safe_load((run_dir / "run.yaml").read_text())
    gates, _ = model_gates({"model": defaults("model", **config["model"]), "tokens": fill})
    header, journaled = read_journal(journal_path(run_dir / "results/chat/responses/00000.jsonl.zst"))
    finished = read_jsonl(run_dir / "results/chat/responses/00001.jsonl.zst")
    stats = read_json(run_dir / "results/chat/responses/00001.stats.json")
    rows = [*journaled.values(), *finished]
    # the budget: 13 answers at $0.001 (failures cost nothing) while the next one's worst case fits ($0.0012:
    # 8 tokens at $150 per million), then no new conversation
    assert len(journaled) < 30 and sum(r["status"] != "failed" for r in journaled.values()) == 13
    assert header["started"] <= time.time()

    progress = run_progress(run_dir, {"chat": ["00000", "00001", "00002"]}, gates)["chat"]
    status = [r["status"] for r in rows]
    usage = [m["usage"] for r in rows for m in r["messages"] if m["role"] == "assistant"]
    assert dict(progress.shards) == {"started": 1, "done": 1, "pending": 1}
    assert progress.prompts == 90
    assert progress.answered == len(rows) - status.count("failed") == 13 + stats["prompts"] - len(stats["failed"])
    assert progress.failed == status.count("failed") > 0
    assert progress.truncated == status.count("truncated") > 0
    # every truncated row is gated, live: the tokens stage has run on neither shard
    assert (progress.gated, dict(progress.gate_counts), progress.gated_live) == (
        progress.truncated,
        {"truncated": progress.truncated},
        2,
    )
    assert progress.tokens == sum(u["prompt_tokens"] + u["completion_tokens"] for u in usage)
    assert progress.cost == pytest.approx(0.001 * progress.answered)
    assert progress.rows_per_s > 0
    table = format_progress({"chat": progress})
    assert table.splitlines()[1].split()[:6] == [
        "chat", "1/1/1", f"{progress.answered}/90", str(progress.failed), str(progress.truncated), str(progress.gated),
    ]  # fmt: skip
    assert f"gated: truncated {progress.truncated} (2 shards gated here" in table
    assert progress.failure_counts == {"bad_request": progress.failed}  # the loopback's 400 names no setting
    assert f"    failed: bad_request {progress.failed}\n" in table

    # Once the tokens stage has run on the finished shard, its audit's count replaces the live one.
    tokens = run_dir / "results/chat/tokens"
    run_tokens(
        run_dir / "results/chat/responses/00001.jsonl.zst", tokens / "00001.jsonl.zst", tokens / "00001.audit.json",
        config["model"]["path"], defaults("model", **config["model"]), token_settings(),
    )  # fmt: skip
    again = run_progress(run_dir, {"chat": ["00000", "00001", "00002"]}, gates)["chat"]
    assert (again.gated, again.gated_live) == (progress.gated, 1)
    later = rates({"chat": progress}, run_progress(run_dir, {"chat": ["00000", "00001", "00002"]}, gates), 10.0)
    assert later["chat"].rows_per_s == 0.0  # nothing finished between the two reads
    (tokens / "00001.audit.json").unlink()


def watch_status(run_dir) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-u", str(REPO / "scripts/status.py"), "--configfile", "run.yaml", "--watch", "0.5"],
        cwd=run_dir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_status_watch_prints_the_progress_until_ctrl_c(run_dir):
    """Ctrl-C ends it at once by the signal's default action (exit status -SIGINT, 130 in a shell): how
    long the tables take to come depends on the machine's load, how long the exit takes does not."""
    proc = watch_status(run_dir)
    lines, deadline = [], time.monotonic() + 600
    # the first table, then one over an interval (after the tokenizer has loaded for the live gates)
    while time.monotonic() < deadline and not any("rows per minute over the last" in line for line in lines):
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=10)
    text = "".join(lines) + rest
    assert proc.returncode == -signal.SIGINT, err
    assert err == ""
    assert text.splitlines()[0].startswith("partition") and "shards d/s/p" in text
    assert "rows per minute over the last" in text and "/90 " in text and "gated: truncated" in text


def test_status_watch_ends_at_ctrl_c_while_it_is_still_loading(run_dir):
    """Ctrl-C before the first table (the interpreter starting, transformers loading for the gates)."""
    proc = watch_status(run_dir)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=10)
    assert proc.returncode == -signal.SIGINT and "rows per minute" not in out
