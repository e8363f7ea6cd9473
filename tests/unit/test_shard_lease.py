"""One copy of a shard's job at a time (formats/shard_lease.py): a second copy waits for the first and finds
its work done; a lease whose holder is gone (a dead pid here, an earlier run of a requeued SLURM job, a
holder whose beat stopped) is taken over; a holder whose lease was taken over stops. The copies are real
processes on this machine; tests/workflow/test_stopped_runs.py restarts a controller on the SLURM test cluster.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from eagle3_datagen.formats import shard_lease
from tests.helpers import REPO

# A shard job as the scripts hold it: the same command line in both copies (their fingerprint), work that
# takes `hold` seconds, its output written last.
COPY = """
import logging, sys, time
from eagle3_datagen.formats.shard_lease import one_copy
logging.basicConfig(level=logging.INFO)
out, inp, hold = sys.argv[1], sys.argv[2], float(sys.argv[3])
with one_copy([out], [inp], beat_s=0.2, poll_s=0.1) as done:
    print("done by the other copy" if done else "working", time.time(), flush=True)
    if not done:
        time.sleep(hold)
        open(out, "w").write("made once")
"""


def copy(tmp_path, hold: float) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", COPY, str(tmp_path / "out"), str(tmp_path / "in"), str(hold)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
    )  # fmt: skip


def lease_of(tmp_path) -> dict:
    return json.loads((tmp_path / ".leases/out.lease").read_text())


def test_a_second_copy_waits_for_the_first_and_finds_its_work_done(tmp_path):
    (tmp_path / "in").write_text("tokens")
    first = copy(tmp_path, hold=3)
    assert first.stdout.readline().startswith("working")
    second = copy(tmp_path, hold=3)
    out, err = second.communicate(timeout=60)
    first_out, _ = first.communicate(timeout=60)
    assert first.returncode == second.returncode == 0
    assert out.startswith("done by the other copy") and float(out.split()[-1]) > (tmp_path / "out").stat().st_mtime
    assert "is being made by another copy of this job" in err and "nothing left to do" in err
    assert (tmp_path / "out").read_text() == "made once"
    assert lease_of(tmp_path)["released"] is True
    # a copy whose inputs changed since does the work again
    (tmp_path / "in").write_text("other tokens")
    third = copy(tmp_path, hold=0)
    assert third.communicate(timeout=60)[0].startswith("working")


def test_a_lease_whose_holder_is_gone_is_taken_over_at_once(tmp_path, monkeypatch):
    (tmp_path / "in").write_text("tokens")
    monkeypatch.chdir(tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    holder = {"token": "t", "host": socket.gethostname(), "pid": int(dead.stdout), "slurm_job": None, "restart": 0}
    path = shard_lease.lease_path(tmp_path / "out")
    path.write_text(json.dumps({**holder, "beat": 3, "fingerprint": "x", "released": False}))
    started = time.monotonic()
    with shard_lease.one_copy([tmp_path / "out"], [tmp_path / "in"], poll_s=0.1) as done:
        assert not done and time.monotonic() - started < 1
        assert lease_of(tmp_path)["pid"] == os.getpid()
    # the same SLURM job before it was requeued, on another node: its pid cannot be asked, its job id can
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    path.write_text(json.dumps({**holder, "host": "gpu-09", "pid": 1, "slurm_job": "77", "beat": 0, "released": False}))
    started = time.monotonic()
    with shard_lease.one_copy([tmp_path / "out"], [tmp_path / "in"], poll_s=0.1) as done:
        assert not done and time.monotonic() - started < 1


def test_a_lease_whose_beat_stopped_is_taken_over_and_a_beating_one_is_not(tmp_path, monkeypatch):
    """A holder on another node (its pid cannot be asked): taken over once its beat has not changed for
    stale_s seconds, as this copy sees it; not while it beats."""
    (tmp_path / "in").write_text("tokens")
    monkeypatch.chdir(tmp_path)
    path = shard_lease.lease_path(tmp_path / "out")
    elsewhere = {"token": "t", "host": "gpu-09", "pid": 1, "slurm_job": "12", "restart": 0, "beat": 0}
    path.write_text(json.dumps({**elsewhere, "fingerprint": "x", "released": False}))
    stop = threading.Event()

    def beat():
        while not stop.wait(0.2):
            record = json.loads(path.read_text())
            path.write_text(json.dumps({**record, "beat": record["beat"] + 1}))

    beating = threading.Thread(target=beat)
    beating.start()
    waiter = threading.Thread(target=lambda: shard_lease._acquire(path, {"token": "w"}, "out", 1.0, 0.1))
    waiter.start()
    waiter.join(timeout=3)
    assert waiter.is_alive() and json.loads(path.read_text())["token"] == "t"  # still waiting: the beat goes on
    stop.set()
    beating.join()
    waiter.join(timeout=10)
    assert not waiter.is_alive() and json.loads(path.read_text())["token"] == "w"


def test_a_holder_whose_lease_was_taken_over_stops(tmp_path):
    (tmp_path / "in").write_text("tokens")
    holder = copy(tmp_path, hold=60)
    assert holder.stdout.readline().startswith("working")
    taken = {**lease_of(tmp_path), "token": "another", "host": "gpu-09"}
    (tmp_path / ".leases/out.lease").write_text(json.dumps(taken))
    _, err = holder.communicate(timeout=30)
    assert holder.returncode == -signal.SIGTERM
    assert "took this shard's lease" in err and "this copy stops rather than write beside it" in err
    assert not (tmp_path / "out").exists() and lease_of(tmp_path)["token"] == "another"
