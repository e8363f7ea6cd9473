"""The node's shared generation server: shard jobs (separate processes) start it once, reuse it,
and it stops when idle, when asked, and on SIGTERM; a job killed with -9 does not keep it alive.

The server here is the loopback double (tests/doubles/loopback.py): these tests are about the
processes' lifetimes, not SGLang. tests/real_sglang/test_workflow.py runs the real server this way.
"""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from eagle3_datagen.backends.sglang.shared import pid_alive, release, request_stop, state_dir

JOB = """
import sys, time, urllib.request
from eagle3_datagen.backends.sglang.shared import shared_server
launch = {"command": [sys.executable, "-m", "tests.doubles.loopback"], "health_timeout": 120, "idle_timeout": %r}
with shared_server(%r, %r, launch, %r):
    with urllib.request.urlopen(%r + "/health", timeout=5) as resp:
        assert resp.status == 200
    print("served", flush=True)
    time.sleep(%r)
"""


def job(model_dir, url, log, hold_s=0.5, idle_s=2.0):
    return subprocess.Popen(
        [sys.executable, "-c", JOB % (idle_s, str(model_dir), url, str(log), url, hold_s)],
        stdout=subprocess.PIPE,
        text=True,
    )


def serving(url) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def wait_until(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def supervisor_pid(url) -> int:
    return json.loads((state_dir(url) / "supervisor.json").read_text())["pid"]


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "Tiny-Model"
    path.mkdir()
    return path


@pytest.fixture
def url():
    url = f"http://127.0.0.1:{23000 + (os.getpid() + time.monotonic_ns() // 1000) % 1000}"
    yield url
    release(url, timeout=60)


def test_shard_jobs_share_one_server_that_stops_when_idle(tmp_path, model_dir, url):
    log = tmp_path / "server.log"
    together = [job(model_dir, url, log, hold_s=1.0) for _ in range(3)]
    assert [j.communicate(timeout=120)[0] for j in together] == ["served\n"] * 3
    later = job(model_dir, url, log)  # within the idle time: the same server
    assert later.communicate(timeout=60)[0] == "served\n"
    assert log.read_text().count("starting the SGLang server") == 1
    pid = supervisor_pid(url)
    assert wait_until(lambda: not serving(url)), "the idle server did not stop"
    assert wait_until(lambda: not (state_dir(url) / "supervisor.json").exists())
    assert wait_until(lambda: not pid_alive(pid))
    again = job(model_dir, url, log)  # after it stopped: a new one
    assert again.communicate(timeout=60)[0] == "served\n"
    assert log.read_text().count("starting the SGLang server") == 2


def test_a_job_killed_with_9_does_not_keep_the_server_and_a_stop_request_ends_it(tmp_path, model_dir, url):
    log = tmp_path / "server.log"
    killed = job(model_dir, url, log, hold_s=600, idle_s=600)
    assert killed.stdout.readline() == "served\n"
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert serving(url)  # the supervisor outlives its starter
    request_stop(url)  # the workflow's onsuccess/onerror: at once, since no live job uses it
    assert wait_until(lambda: not serving(url), timeout=30)


def test_a_stop_request_waits_for_the_job_using_the_server(tmp_path, model_dir, url):
    log = tmp_path / "server.log"
    user = job(model_dir, url, log, hold_s=3, idle_s=600)
    assert user.stdout.readline() == "served\n"
    request_stop(url)
    time.sleep(1)
    assert serving(url) and user.poll() is None
    user.wait(timeout=60)
    assert wait_until(lambda: not serving(url), timeout=30)


def test_sigterm_to_the_supervisor_stops_the_server(tmp_path, model_dir, url):
    log = tmp_path / "server.log"
    user = job(model_dir, url, log, hold_s=0, idle_s=600)
    assert user.communicate(timeout=60)[0] == "served\n"
    os.kill(supervisor_pid(url), signal.SIGTERM)
    assert wait_until(lambda: not serving(url), timeout=30)
