"""Shard jobs that use the node's launched server at once (`inference.sglang.launch.shard_jobs`): the next
shard's requests start while the last one's long answers drain, never more in flight together than the
server's concurrency (the tiers' sum), each prompt answered once.

The server is the loopback stand-in (tests/doubles/loopback.py), launched as the workflow launches
`sglang.launch_server`, with the answers' lengths stood in by their latency (`slow`: a shard's long
answers): these tests are about which job sends what when, which SGLang's own answers do not change.
bench/fed_server_cpu.py measures the same with real SGLang on the CPU (BENCHMARKS.md).
"""

import json
import subprocess
import sys
import urllib.request

from eagle3_datagen.formats.files import read_jsonl, write_jsonl_zst
from tests.helpers import REPO, defaults, free_port, wait_until

JOB = """
import json, logging, sys
from eagle3_datagen.stages.responses.job import run_response_job
logging.basicConfig(level=logging.INFO)
run_response_job([tuple(json.loads(sys.argv[1]))], json.loads(sys.argv[2]), sys.argv[3])
"""
LONG = "[long answer]"
SHORT_TIER, LONG_TIER = 4, 1  # the server's concurrency: 5 conversations in flight


def settings(model_dir, url: str, faults: dict) -> dict:
    command = [sys.executable, "-m", "tests.doubles.loopback", "--faults", json.dumps(faults)]
    tiers = {"short": {"concurrency": SHORT_TIER}, "long": {"concurrency": LONG_TIER}}
    launch = {"command": command, "health_timeout": 120, "idle_timeout": 30}
    return {
        "backend": "sglang",
        "sampling": defaults("inference.sampling", temperature=0.0, max_new_tokens=16),
        "sglang": defaults("inference.sglang", url=url, launch=launch, tiers=tiers),
        "model": defaults("model", path=str(model_dir)),
        "gpus": 0,
        "handover": defaults("resources.handover"),
        "max_failed_rate": 0.0,
    }


def shard(folder, name: str, texts: list[str]) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    rows = [
        {"id": f"{name}-{i}", "source": "test", "messages": [{"role": "user", "content": t}]}
        for i, t in enumerate(texts)
    ]
    write_jsonl_zst(folder / f"{name}.prompts.jsonl.zst", rows)
    return [
        str(folder / f"{name}.prompts.jsonl.zst"),
        str(folder / f"{name}.jsonl.zst"),
        str(folder / f"{name}.stats.json"),
    ]


def stats(url: str) -> dict:
    with urllib.request.urlopen(url + "/stats", timeout=10) as response:
        return json.loads(response.read())


def answered(url: str) -> int:
    """How many /generate requests the server has answered; -1 while it does not answer yet."""
    try:
        return len(stats(url)["generated"])
    except OSError:
        return -1


def test_the_next_shard_fills_the_server_while_the_last_ones_long_answers_drain(tmp_path, node, qwen_tokenizer_dir):
    url = f"http://127.0.0.1:{free_port()}"
    # the long answers last until the test releases them, after the next shard is done (a loaded machine
    # may take a minute to start a job)
    released = tmp_path / "released"
    faults = {"latency_s": 0.05, "slow": {LONG: 600.0}, "release": str(released)}
    job_settings = json.dumps(settings(qwen_tokenizer_dir, url, faults))
    first = shard(
        tmp_path / "results", "first", [f"Tell {i}. {LONG}" for i in range(3)] + [f"Ask {i}." for i in range(3)]
    )
    second = shard(tmp_path / "results", "second", [f"Next {i}." for i in range(8)])
    log = str(tmp_path / "server.log")

    def job(paths):
        command = [sys.executable, "-c", JOB, json.dumps(paths), job_settings, log]
        return subprocess.Popen(command, cwd=REPO, stderr=subprocess.PIPE, text=True)

    before = job(first)
    # the first shard's short answers are back: it is in its tail, its three long answers in flight
    assert wait_until(lambda: answered(url) == 3, 120)
    after = job(second)
    _, after_log = after.communicate(timeout=300)
    assert before.poll() is None, "the first shard's job ended before its long answers were released"
    released.touch()
    _, before_log = before.communicate(timeout=120)
    assert (before.returncode, after.returncode) == (0, 0), before_log[-2000:] + after_log[-2000:]

    served = stats(url)
    order = [next(p for p in ("Tell", "Ask", "Next") if f"{p} " in prompt) for prompt in served["generated"]]
    # the second shard was answered whole while the first one's long answers were in flight
    assert order == ["Ask"] * 3 + ["Next"] * 8 + ["Tell"] * 3, before_log[-3000:] + after_log[-3000:]
    # the second job took what the first one's tail left of the server's concurrency, no more
    assert f"share of the node's server's concurrency: 2 of {SHORT_TIER + LONG_TIER}, 2 jobs" in after_log
    assert served["max_in_flight"] == SHORT_TIER + LONG_TIER
    # each prompt asked and answered once, each shard's output whole
    assert sorted(served["completed"].values()) == [1] * 14 and sum(served["attempts"].values()) == 14
    for paths, count in ((first, 6), (second, 8)):
        assert [r["status"] for r in read_jsonl(paths[1])] == ["ok"] * count
