"""The node directory of this user's service: its lock, the service's record, its users.

In the directory: `lock` (held while the record or the users change), `supervisor.json` (the
record: token, key, name, log, supervisor and service pids, where it runs, and `ready_s` once the
service is ready), `users/<pid>` (the jobs registered with it), `stop` (a stop was asked),
`loaded` (written by a service without a health URL once its model is loaded) and `failed.json` (why
the last service did not start or ended, for the jobs that waited on it). Jobs read the record
without the lock, so it is only ever replaced whole.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

from eagle3_datagen.formats.files import write_json

# How often jobs and the supervisor look at the node directory.
POLL_S = 0.5
SERVICE_DIR_ENV = "EAGLE3_DATAGEN_SERVICE_DIR"
LOADED = "loaded"
STOP = "stop"
RECORD = "supervisor.json"
FAILED = "failed.json"


def node_dir() -> Path:
    """The node-local directory of this user's service (one per SLURM allocation)."""
    job = os.environ.get("SLURM_JOB_ID")
    return Path(tempfile.gettempdir()) / (f"eagle3-datagen-{os.getuid()}" + (f"-slurm{job}" if job else ""))


def where() -> str:
    """This process's node, and its SLURM job and step where it runs in one."""
    place = socket.gethostname()
    if job := os.environ.get("SLURM_JOB_ID"):
        place += f" (SLURM job {job}, step {os.environ.get('SLURM_STEP_ID', 'batch')})"
    return place


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie (a process this one started, not yet reaped) is not alive
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    return True


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def read_record(directory: Path, token: str | None = None) -> dict | None:
    """The record as written (of the service `token`, if given), or None."""
    with contextlib.suppress(OSError, ValueError):
        record = json.loads((directory / RECORD).read_text())
        if token is None or record["token"] == token:
            return record
    return None


def running_record(directory: Path) -> dict | None:
    """The running service's record, or None: none runs, or its process has exited and its supervisor
    is still cleaning up."""
    record = read_record(directory)
    if record and pid_alive(record["pid"]) and pid_alive(record.get("service_pid", record["pid"])):
        return record
    return None


def update_record(directory: Path, token: str, **fields) -> bool:
    """Add `fields` to the record of the service `token`; False when another's record replaced it. The
    caller holds the node lock."""
    record = read_record(directory, token)
    if record is not None:
        write_json(directory / RECORD, record | fields)
    return record is not None


def remove_record(directory: Path, token: str) -> None:
    """Remove the record of the service `token` and what it marked (a no-op once another's replaced it);
    the caller holds the node lock."""
    if read_record(directory, token) is not None:
        for name in (RECORD, LOADED):
            (directory / name).unlink(missing_ok=True)


def record_failure(directory: Path, token: str, message: str) -> None:
    """Say why the service `token` did not start or ended, for the jobs that wait on it (`failure`)."""
    write_json(directory / FAILED, {"token": token, "message": message})


def failure(directory: Path, token: str) -> str | None:
    """Why the service `token` did not start or ended, if its supervisor said."""
    with contextlib.suppress(OSError, ValueError):
        failed = json.loads((directory / FAILED).read_text())
        if failed["token"] == token:
            return failed["message"]
    return None


def live_users(directory: Path) -> list[int]:
    """The registered jobs that are alive; those that are gone (killed with -9) are dropped."""
    users = directory / "users"
    live = []
    for entry in users.glob("*") if users.is_dir() else []:
        if pid_alive(int(entry.name)):
            live.append(int(entry.name))
        else:
            entry.unlink(missing_ok=True)
    return live


def mark_loaded() -> None:
    """Called by a service without a health URL (in the process its supervisor started) once it is ready."""
    (Path(os.environ[SERVICE_DIR_ENV]) / LOADED).touch()
