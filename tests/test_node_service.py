"""The node's shared service: shard jobs (separate processes) start it once, reuse it, and it stops when
idle, when asked, and on SIGTERM; a job killed with -9 does not keep it alive; a job that needs another
service waits until the running one is unused, then replaces it.

The server here is the loopback double (tests/doubles/loopback.py), launched as the workflow launches
`sglang.launch_server`: these tests are about the processes' lifetimes, not SGLang.
tests/real_sglang/test_workflow.py runs the real server this way.
"""

import os
import signal
import socket
import subprocess
import sys
from datetime import datetime

import pytest

from eagle3_datagen.backends.service import Service, launch
from eagle3_datagen.backends.service.lease import request_stop
from eagle3_datagen.backends.service.record import node_dir, pid_alive, running_record
from eagle3_datagen.backends.service.supervise import healthy
from eagle3_datagen.formats.files import read_jsonl

from .conftest import REPO, defaults, free_port, wait_until

JOB = """
import sys, time
from eagle3_datagen.backends.service.lease import using
from eagle3_datagen.backends.sglang.server import server_service
from eagle3_datagen.config_schema import fill_defaults
launch = {"command": [sys.executable, "-m", "tests.doubles.loopback"], "health_timeout": 120, "idle_timeout": %r}
launch = fill_defaults(launch, "inference.sglang.launch")
with using(server_service(%r, %r, launch, %r)):
    print("served", flush=True)
    time.sleep(%r)
"""


def supervisor() -> dict | None:
    return running_record(node_dir())


def job(model_dir, url, log, hold_s=0.5, idle_s=8.0):
    return subprocess.Popen(
        [sys.executable, "-c", JOB % (idle_s, str(model_dir), url, str(log), hold_s)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "Tiny-Model"
    path.mkdir()
    return path


@pytest.fixture
def url():
    return f"http://127.0.0.1:{free_port()}"


def test_shard_jobs_share_one_server_that_stops_when_idle(tmp_path, node, model_dir, url):
    log = tmp_path / "server.log"
    together = [job(model_dir, url, log, hold_s=1.0) for _ in range(3)]
    assert [j.communicate(timeout=120)[0] for j in together] == ["served\n"] * 3
    later = job(model_dir, url, log)  # within the idle time: the same server
    assert later.communicate(timeout=60)[0] == "served\n"
    assert log.read_text().count("starting the SGLang server") == 1
    assert log.read_text().count("SGLang server ready after") == 1
    pid = supervisor()["pid"]
    assert wait_until(lambda: not healthy(url)), "the idle server did not stop"
    assert wait_until(lambda: supervisor() is None) and wait_until(lambda: not pid_alive(pid))
    assert "no job uses the SGLang server; stopping it" in log.read_text()
    again = job(model_dir, url, log)  # after it stopped: a new one
    assert again.communicate(timeout=60)[0] == "served\n"
    assert log.read_text().count("starting the SGLang server") == 2
    # each load recorded for the plan, beside the service's log
    loads = read_jsonl(tmp_path / "loads.jsonl")
    assert [(r["service"], r["model"], r["node"]) for r in loads] == [
        ("generation_server", str(model_dir.resolve()), socket.gethostname())
    ] * 2
    assert all(0 < r["seconds"] < 120 and datetime.fromisoformat(r["time"]).tzinfo for r in loads)


def test_a_job_killed_with_9_does_not_keep_the_server_and_a_stop_request_ends_it(tmp_path, node, model_dir, url):
    log = tmp_path / "server.log"
    killed = job(model_dir, url, log, hold_s=600, idle_s=600)
    assert killed.stdout.readline() == "served\n"
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert healthy(url)  # the supervisor outlives its starter
    request_stop()  # the workflow's onsuccess/onerror: at once, since no live job uses it
    assert wait_until(lambda: not healthy(url), timeout=30)


def test_a_stop_request_waits_for_the_job_using_the_server(tmp_path, node, model_dir, url):
    log = tmp_path / "server.log"
    user = job(model_dir, url, log, hold_s=3, idle_s=600)
    assert user.stdout.readline() == "served\n"
    request_stop()
    assert wait_until(lambda: "a stop was asked; the SGLang server stops once no job uses it" in log.read_text())
    assert healthy(url) and user.poll() is None
    user.wait(timeout=60)
    assert wait_until(lambda: not healthy(url), timeout=30)


def test_sigterm_to_the_supervisor_stops_the_server(tmp_path, node, model_dir, url):
    log = tmp_path / "server.log"
    user = job(model_dir, url, log, hold_s=0, idle_s=600)
    assert user.communicate(timeout=60)[0] == "served\n"
    os.kill(supervisor()["pid"], signal.SIGTERM)
    assert wait_until(lambda: not healthy(url), timeout=30)
    assert wait_until(lambda: supervisor() is None, timeout=30)


def test_a_job_needing_another_service_waits_until_the_running_one_is_unused(tmp_path, node, model_dir, url):
    """One service per node (both want its GPUs): a server with other flags starts only once the jobs
    of the first have left, and the first is stopped before the second starts."""
    log = tmp_path / "server.log"
    first = job(model_dir, url, log, hold_s=4, idle_s=600)
    assert first.stdout.readline() == "served\n"
    other_url = f"http://127.0.0.1:{free_port()}"
    second = job(model_dir, other_url, log, hold_s=0, idle_s=600)
    assert wait_until(lambda: "a stop was asked; the SGLang server stops once no job uses it" in log.read_text())
    assert second.poll() is None and not healthy(other_url)  # waiting for the first one's job
    assert second.communicate(timeout=120)[0] == "served\n"
    assert first.wait(timeout=10) == 0
    text = log.read_text()
    stopped = text.index("no job uses the SGLang server; stopping it")
    assert text.count("starting the SGLang server") == 2
    assert text.index("starting the SGLang server", stopped) > stopped  # the second began after the first stopped
    assert not healthy(url)


def test_under_slurm_the_supervisor_is_a_job_step_of_its_own(monkeypatch, tmp_path):
    """Inside an allocation the service gets its own step (a step's leftovers die with it under
    proctrack/cgroup), on this node, with the job step's own SLURM settings cleared."""
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURMD_NODENAME", "gpu-07")
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", "96")
    monkeypatch.setattr(launch.shutil, "which", lambda name: f"/usr/bin/{name}")
    runner = defaults("hidden_states.runner")
    log = str(tmp_path / "runner.log")
    timeouts = {"ready_timeout": runner["load_timeout"], "idle_timeout": runner["idle_timeout"]}
    service = Service("capture runner", "capture_runner", "/m", "k", ["torchrun"], log, **timeouts, gpus=8)
    step = launch.slurm_step(service)
    assert step[:7] == ["srun", "--overlap", "--jobid=42", "--nodes=1", "--ntasks=1", "--nodelist=gpu-07", "--mem=0"]
    assert "--cpus-per-task=96" in step and "--gpus=8" in step
    assert f"--output={tmp_path / 'runner.log'}" in step and "--open-mode=append" in step
    assert node_dir().name.endswith("-slurm42")
    assert launch.log_path("logs/capture_runner/runner.log").name == "runner.slurm-42.log"
    monkeypatch.delenv("SLURM_JOB_ID")
    assert launch.slurm_step(service) == []
