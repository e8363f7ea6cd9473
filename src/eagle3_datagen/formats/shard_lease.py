"""One copy of a shard's job at a time, across nodes, requeues and controller restarts: a lease file on the
filesystem the jobs share.

A Snakemake controller restarted after a crash (`--unlock`, then the same command) submits again every
shard whose output is missing, those whose first copies still run in SLURM included (a job outlives the
controller that submitted it). Two copies of a shard would write one journal (responses) or one set of
parts (hidden states) at once. So a shard's job holds a lease on its output while it works on it: a file
under `.leases/` in the working directory (the workflow's, which its jobs share), at the output's path,
created with O_EXCL, naming its holder (host, pid, SLURM job and restart count) and rewritten every
`beat_s` seconds. A second copy waits while the lease is held, then
goes on: if the first copy finished the same work (its lease, left as released, has this job's
fingerprint: its command line and its inputs' sizes and times) and the outputs are there, nothing is
left to do; otherwise it resumes from what the first left (complete parts, journaled prompts).

A lease is taken over at once when its holder is gone: an earlier run of the same SLURM job (requeued:
a lower SLURM_RESTART_COUNT), or a pid that no longer runs on this host; otherwise once its beat has not
changed for `stale_s` seconds, as the waiter sees it (no clock is compared between nodes). A holder whose
lease another took over (it was stopped longer than `stale_s`) stops its own process rather than write
beside the new holder. Two waiters that take over one stale lease in the same instant could both hold it:
the window is between reading the lease and removing it, after both saw it stale for `stale_s` seconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from eagle3_datagen.formats.files import write_json

log = logging.getLogger(__name__)

BEAT_S = 10.0
STALE_S = 180.0
POLL_S = 5.0
# How often a waiting copy says again what it waits for.
REPORT_EVERY_S = 600.0


LEASES = ".leases"


def lease_path(output: str | os.PathLike) -> Path:
    """`.leases/<output>.lease` in the working directory (an output outside it: at its absolute path there)."""
    output = Path(output).resolve()
    cwd = Path.cwd().resolve()
    under = output.relative_to(cwd) if output.is_relative_to(cwd) else Path("abs", *output.parts[1:])
    path = cwd / LEASES / under.with_name(f"{under.name}.lease")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def fingerprint(inputs: Sequence[str | os.PathLike]) -> str:
    """This job's command line and its inputs' sizes and modification times: two copies with the same one
    make the same outputs."""
    stats = [(str(p), os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in inputs if os.path.exists(p)]
    return hashlib.sha256(json.dumps([sys.argv[1:], stats]).encode()).hexdigest()


def _me() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "slurm_job": os.environ.get("SLURM_JOB_ID"),
        "restart": int(os.environ.get("SLURM_RESTART_COUNT") or 0),
    }


def _read(path: Path) -> dict | None:
    """The lease as written; {} while its creator has not written it yet; None when there is none."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    with contextlib.suppress(ValueError):
        return json.loads(text)
    return {}


def _describe(holder: dict) -> str:
    if not holder:
        return "a copy that is starting"
    where = f"SLURM job {holder['slurm_job']} on {holder['host']}" if holder.get("slurm_job") else holder["host"]
    return f"another copy of this job ({where}, pid {holder['pid']}, since {holder.get('since', '?')})"


def gone(holder: dict) -> bool:
    """Whether the holder is known to be gone without waiting for its beat to stop."""
    if not holder or holder.get("released"):
        return bool(holder.get("released"))
    me = _me()
    if holder.get("slurm_job") and holder["slurm_job"] == me["slurm_job"] and holder["restart"] < me["restart"]:
        return True  # this job before SLURM requeued it
    if holder["host"] == me["host"]:
        try:
            os.kill(holder["pid"], 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
    return False


class _Beat(threading.Thread):
    """Rewrites the lease every `beat_s` s while its holder works; stops the holder's process if another copy
    took the lease over."""

    def __init__(self, path: Path, record: dict, beat_s: float):
        super().__init__(daemon=True)
        self.path, self.record, self.beat_s = path, record, beat_s
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.beat_s):
            current = _read(self.path)
            if current is None or current.get("token") != self.record["token"]:
                log.error(
                    "%s took this shard's lease (%s) while this job was stopped; this copy stops rather than "
                    "write beside it",
                    _describe(current or {}),
                    self.path,
                )
                os.kill(os.getpid(), signal.SIGTERM)
                return
            self.record["beat"] += 1
            write_json(self.path, self.record)


def _take_over(path: Path, seen: dict) -> None:
    """Remove the lease `seen`, unless it changed since (another waiter took it over first)."""
    if _read(path) == seen:
        path.unlink(missing_ok=True)


def _acquire(path: Path, record: dict, what: str, stale_s: float, poll_s: float) -> dict | None:
    """Create the lease; returns the released lease it replaced, if any."""
    seen, seen_since, reported = None, time.monotonic(), None
    while True:
        try:
            descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            pass
        else:
            with os.fdopen(descriptor, "w") as out:
                out.write(json.dumps(record))
            return seen if seen and seen.get("released") else None
        current = _read(path)
        if current is None:
            continue  # released and removed meanwhile
        if current != seen:
            seen, seen_since = current, time.monotonic()
        if gone(current) or time.monotonic() - seen_since > stale_s:
            if not current.get("released"):
                log.warning("taking over the lease of %s: %s is gone (%s)", what, _describe(current), path)
            _take_over(path, current)
            continue
        if reported is None or time.monotonic() - reported > REPORT_EVERY_S:
            log.info(
                "%s is being made by %s; waiting for it to finish (a second copy would write beside it)",
                what,
                _describe(current),
            )
            reported = time.monotonic()
        time.sleep(poll_s)


@contextlib.contextmanager
def one_copy(
    outputs: Sequence[str | os.PathLike],
    inputs: Sequence[str | os.PathLike],
    beat_s: float = BEAT_S,
    stale_s: float = STALE_S,
    poll_s: float = POLL_S,
) -> Iterator[bool]:
    """Hold the lease of a job that makes `outputs` from `inputs` for the duration of the block, after any
    other copy of it is done. Yields True when that copy made the same outputs (nothing left to do). The
    lease is left as released (with the job's fingerprint) when the block ends normally, removed otherwise."""
    path, what = lease_path(outputs[0]), str(outputs[0])
    mine = fingerprint(inputs)
    record = {"token": uuid.uuid4().hex, **_me(), "since": time.strftime("%Y-%m-%d %H:%M:%S"), "beat": 0}
    record |= {"fingerprint": mine, "released": False}
    released = _acquire(path, record, what, stale_s, poll_s)
    done = bool(released and released["fingerprint"] == mine and all(os.path.exists(o) for o in outputs))
    if done:
        log.info("another copy of this job made %s from the same inputs and settings: nothing left to do", what)
    beat = _Beat(path, record, beat_s)
    beat.start()
    finished = False
    try:
        yield done
        finished = True
    finally:
        beat.stopped.set()
        beat.join()
        if (_read(path) or {}).get("token") == record["token"]:
            if finished:
                write_json(path, record | {"released": True})
            else:
                path.unlink(missing_ok=True)
