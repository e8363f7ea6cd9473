"""The node's capture runner with the `hf` backend, for real: hidden-state jobs are
`scripts/hidden_states.py` processes, the runner is `scripts/capture_runner.py` under its supervisor,
the model a tiny Qwen3. tests/real_sglang/test_workflow.py runs the SGLang runner (torchrun ranks) in the
workflow.
"""

import json
import os
import signal

import torch

from eagle3_datagen.backends.hf.capture import HFCapture
from eagle3_datagen.formats.files import read_jsonl, write_jsonl_zst
from eagle3_datagen.formats.hidden_shard import HiddenShard
from eagle3_datagen.stages.hidden.shard import capture_shard
from tests.helpers import hidden_job, make_samples, runner_job_settings, runner_log, wait_until


def test_shard_jobs_share_one_runner_and_write_what_an_in_process_capture_writes(tmp_path, node, tiny_model_dir):
    shards = [make_samples(12, seed=s) for s in range(3)]
    for number, samples in enumerate(shards):
        write_jsonl_zst(tmp_path / f"{number}.jsonl.zst", samples)
    for number in range(3):
        tokens, out = tmp_path / f"{number}.jsonl.zst", tmp_path / f"out{number}"
        assert hidden_job(tmp_path, tokens, out, runner_job_settings(tiny_model_dir)).wait() == 0
    log = runner_log(tmp_path)
    assert log.count("starting the capture runner") == 1 and log.count("capture runner ready after") == 1
    (load,) = read_jsonl(tmp_path / "logs/capture_runner/loads.jsonl")  # the one load, recorded for the plan
    assert (load["service"], load["model"]) == ("capture_runner", str(tiny_model_dir.resolve()))
    assert log.count("capturing ") == 3
    job_log = (tmp_path / "out1.log").read_text()
    assert "using the capture runner already running on this node" in job_log
    # the runner's lines for this shard
    assert "part 0: " in job_log and f"capturing {tmp_path / '1.jsonl.zst'}" in job_log

    torch.set_num_threads(1)  # as the runner: --threads 1
    capture = HFCapture(tiny_model_dir, "auto", "raw", {"dtype": "float32", "device": "cpu"})
    hidden = runner_job_settings(tiny_model_dir)["hidden_states"]
    for number, samples in enumerate(shards):
        reference = capture_shard(samples, tmp_path / f"ref{number}", capture, hidden)
        written = json.loads((tmp_path / f"out{number}/index.json").read_text())
        assert written["parts"] == reference["parts"]  # byte-identical parts (their checksums)
        assert HiddenShard(tmp_path / f"out{number}").ids == [s["id"] for s in samples]


def test_a_job_killed_with_9_cancels_its_shard_and_its_rerun_resumes_in_the_same_runner(tmp_path, node, tiny_model_dir):
    samples = make_samples(600, seed=3)
    write_jsonl_zst(tmp_path / "big.jsonl.zst", samples)
    job_settings = runner_job_settings(tiny_model_dir, shard_bytes=4_000)
    partial = tmp_path / ".out.partial"
    killed = hidden_job(tmp_path, tmp_path / "big.jsonl.zst", tmp_path / "out", job_settings)
    wait_until(lambda: len(list(partial.glob("part-*.safetensors"))) >= 3, timeout=120, interval=0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    cancelled = "cancelled; its complete parts are kept for the rerun"
    assert wait_until(lambda: cancelled in runner_log(tmp_path))  # at the runner's next part
    kept = sorted(partial.glob("part-*.safetensors"))
    assert len(kept) >= 3 and not (tmp_path / "out").exists()
    assert hidden_job(tmp_path, tmp_path / "big.jsonl.zst", tmp_path / "out", job_settings).wait() == 0
    log = runner_log(tmp_path)
    assert log.count("starting the capture runner") == 1  # the rerun used the runner the killed job started
    assert log.count("complete from an earlier run, kept") >= len(kept) - 1  # the last may have been mid-write
    assert HiddenShard(tmp_path / "out").ids == [s["id"] for s in samples]


def test_a_failed_shard_fails_its_job_and_a_runner_for_other_settings_replaces_this_one(tmp_path, node, tiny_model_dir):
    write_jsonl_zst(tmp_path / "t.jsonl.zst", make_samples(4))
    missing = hidden_job(tmp_path, tmp_path / "missing.jsonl.zst", tmp_path / "o1", runner_job_settings(tiny_model_dir))
    assert missing.wait() == 2  # a user error: one line, exit 2
    job_log = (tmp_path / "o1.log").read_text()
    assert "the capture runner failed on" in job_log and "FileNotFoundError" in job_log
    assert "missing.jsonl.zst" in job_log
    # The runner stopped after the error; the next job loads a fresh one, with other load settings: another key.
    tokens = tmp_path / "t.jsonl.zst"
    assert hidden_job(tmp_path, tokens, tmp_path / "o2", runner_job_settings(tiny_model_dir)).wait() == 0
    normed = runner_job_settings(tiny_model_dir, final="normed")
    assert hidden_job(tmp_path, tokens, tmp_path / "o3", normed).wait() == 0
    log = runner_log(tmp_path)
    assert log.count("capture runner ready after") == 3
    assert len(read_jsonl(tmp_path / "logs/capture_runner/loads.jsonl")) == 3
    assert log.count("no job uses the capture runner; stopping it") == 1  # replaced for final: normed
    assert json.loads((tmp_path / "o3/index.json").read_text())["final"] == "normed"
    assert os.path.exists(tmp_path / "o2/index.json")
