"""The node's shared service: shard jobs (separate processes) start it once, reuse it, and it stops when
idle, when asked, and on SIGTERM; a job killed with -9 does not keep it alive; a job that needs another
service waits until the running one is unused, then replaces it; a service on GPUs starts once their
memory is free, or fails naming the processes that hold it.

The server here is the loopback double (tests/doubles/loopback.py), launched as the workflow launches
`sglang.launch_server`: these tests are about the processes' lifetimes, not SGLang.
tests/real_sglang/test_workflow.py runs the real server this way. This machine has no GPU: the GPUs'
memory comes from a stand-in `nvidia-smi` on PATH (tests/doubles/nvidia_smi.py), the one stand-in here.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime

import pytest

from eagle3_datagen.backends.service import Service, gpus, launch
from eagle3_datagen.backends.service.lease import request_stop
from eagle3_datagen.backends.service.record import node_dir, pid_alive, running_record
from eagle3_datagen.backends.service.supervise import healthy
from eagle3_datagen.formats.files import read_jsonl
from tests.helpers import REPO, defaults, free_port, runner_job_settings, wait_until

JOB = """
import sys, time
from eagle3_datagen.backends.service.lease import using
from eagle3_datagen.backends.plugins import GENERATION
from eagle3_datagen.config_schema import fill_defaults
launch = {"command": [sys.executable, "-m", "tests.doubles.loopback"], "health_timeout": 120, "idle_timeout": %r}
launch = fill_defaults(launch, "inference.sglang.launch")
model, url, log, gpus, handover = %r, %r, %r, %r, %r
settings = {"sglang": {"url": url, "launch": launch}, "model": {"path": model}, "gpus": gpus, "handover": handover}
with using(GENERATION["sglang"].launched_service(settings, log)):
    print("served", flush=True)
    time.sleep(%r)
"""


def supervisor() -> dict | None:
    return running_record(node_dir())


def job(model_dir, url, log, hold_s=0.5, idle_s=8.0, gpus=0, handover=None, stderr=None):
    return subprocess.Popen(
        [sys.executable, "-c", JOB % (idle_s, str(model_dir), url, str(log), gpus, handover, hold_s)],
        stdout=subprocess.PIPE,
        stderr=stderr,
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
    # held long enough for the second job to start and ask on a loaded machine (4 s was not, once)
    first = job(model_dir, url, log, hold_s=15, idle_s=600)
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


SCHEDULER = {"pid": 4242, "name": "sglang::scheduler_TP1", "used": 70000, "gpu": "GPU-1"}


def test_a_server_on_gpus_starts_once_their_memory_is_freed(tmp_path, node, model_dir, url, stand_in_nvidia_smi):
    """The processes of the service before still hold a GPU's memory when the next one is asked for: it
    waits, saying who holds it, and starts once nvidia-smi reports the memory free."""
    freed_at = time.time() + 5
    stand_in_nvidia_smi([{**SCHEDULER, "freed_at": freed_at}])
    log = tmp_path / "server.log"
    started = time.time()
    served = job(model_dir, url, log, hold_s=0, gpus=2, handover={"timeout": 60, "max_used_mib": 1024})
    assert served.communicate(timeout=120)[0] == "served\n"
    elapsed = time.time() - started
    text = log.read_text()
    assert (
        "waiting for the GPUs' memory before the SGLang server starts: GPU 1 70000 of 81559 MiB in use, held by "
        "pid 4242 (sglang::scheduler_TP1, 70000 MiB on GPU 1)"
    ) in text
    waited = float(re.search(r"the GPUs' memory is free after ([\d.]+) s; starting the SGLang server", text)[1])
    assert 0 < waited < freed_at - started + 5
    start = re.search(r"^(\S+ \S+) INFO \S+: starting the SGLang server on", text, re.M)[1]
    assert datetime.strptime(start, "%Y-%m-%d %H:%M:%S,%f").timestamp() >= freed_at  # not before the free
    # the load's seconds leave the wait out (the plan's load_seconds): with it in, the two would add up to
    # more than the job took (a comparison with the wait alone failed when a loaded machine made the load slow)
    (load,) = read_jsonl(tmp_path / "loads.jsonl")
    assert load["seconds"] + waited <= elapsed


def test_a_server_on_gpus_whose_memory_is_never_freed_fails_naming_the_holders(
    tmp_path, node, model_dir, url, stand_in_nvidia_smi
):
    stand_in_nvidia_smi([{**SCHEDULER, "freed_at": None}, {**SCHEDULER, "pid": 4243, "gpu": "GPU-0", "used": 3000,
                                                           "name": "python3", "freed_at": None}])  # fmt: skip
    log = tmp_path / "server.log"
    failed = job(model_dir, url, log, gpus=2, handover={"timeout": 3, "max_used_mib": 1024}, stderr=subprocess.PIPE)
    out, err = failed.communicate(timeout=120)
    assert failed.returncode != 0 and out == ""
    # the job says why, first: the supervisor's reason (record.failure), not a log's tail
    assert (
        "ServiceError: the GPUs' memory was not free after 3 s, so the SGLang server did not start: "
        "GPU 0 3000 of 81559 MiB, GPU 1 70000 of 81559 MiB in use, held by "
        "pid 4242 (sglang::scheduler_TP1, 70000 MiB on GPU 1); pid 4243 (python3, 3000 MiB on GPU 0). "
        "Stop those processes (or wait for them to exit) and rerun"
    ) in err, err
    assert "starting the SGLang server on" not in log.read_text()  # never started
    assert supervisor() is None and not healthy(url)


def test_the_gpus_checked_are_those_cuda_visible_devices_names():
    found = [gpus.Gpu(0, "GPU-aa", 0, 80), gpus.Gpu(1, "GPU-bb", 500, 80), gpus.Gpu(2, "GPU-cc", 9000, 80)]
    assert gpus.visible(found, None) == found
    assert gpus.visible(found, "0,2") == [found[0], found[2]]
    assert gpus.visible(found, "GPU-bb") == [found[1]]
    assert gpus.busy(found, 1024) == [found[2]]
    assert gpus.describe_busy([found[2]], [], found) == (
        "GPU 2 9000 of 80 MiB in use; nvidia-smi names no process (one of another container or user, or a driver leak)"
    )


def test_the_capture_runner_on_gpus_waits_for_their_memory_as_the_server_does(tmp_path):
    """The runner is a service of the same supervisor: on GPUs (SGLang's ranks) it waits for their memory."""
    from eagle3_datagen.stages.hidden.runner import runner_service

    handover = {"timeout": 300, "max_used_mib": 1024}
    settings = {**runner_job_settings(tmp_path), "tensor_parallel": 8, "handover": handover}
    settings["hidden_states"] = {**settings["hidden_states"], "backend": "sglang"}
    service = runner_service(settings, 4, "scripts/capture_runner.py")
    assert (service.gpus, service.handover, service.command[0]) == (8, handover, "torchrun")


def test_the_capture_runner_runs_in_the_interpreter_hidden_states_runner_python_names(tmp_path):
    """Absent, the job's own interpreter (torchrun for SGLang's ranks); given, that interpreter, torchrun's
    module in it for a tensor-parallel backend."""
    from eagle3_datagen.stages.hidden.runner import runner_service

    python = ".venv-vllm/bin/python"
    settings = runner_job_settings(tmp_path)
    assert runner_service(settings, 2, "runner.py").command[:2] == [sys.executable, "runner.py"]
    given = {**settings["hidden_states"]["runner"], "python": python}
    vllm = {**settings, "hidden_states": {**settings["hidden_states"], "backend": "vllm", "runner": given}}
    assert runner_service(vllm, 2, "runner.py").command[:2] == [python, "runner.py"]
    sglang = {**vllm, "tensor_parallel": 2, "hidden_states": {**vllm["hidden_states"], "backend": "sglang"}}
    assert runner_service(sglang, 2, "runner.py").command[:7] == [
        python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "runner.py"
    ]  # fmt: skip
