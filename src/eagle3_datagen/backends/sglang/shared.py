"""One SGLang server per node, shared by every responses shard job that runs there.

The first shard job on a node starts a supervisor (a detached process: it outlives the job) that
launches the server; every shard job registers under a node-local lock and waits for it to be
healthy. The supervisor stops the server once no registered job is alive for `idle_timeout`
seconds, at once when asked to (`request_stop`: the workflow's onsuccess/onerror where Snakemake
runs on the node, and a capture job that needs the GPUs), and on SIGTERM. A job killed with -9
counts as gone (its pid is dead), so a rerun finds the server still up and reuses it.

Nothing of this is in Snakemake's DAG: the server is no job's input or output, so adding a shard
reschedules no finished one.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eagle3_datagen.backends.base import ServerError
from eagle3_datagen.backends.sglang.server import launched_server, server_command, wait_healthy

log = logging.getLogger(__name__)

POLL_S = 0.5


def state_dir(url: str) -> Path:
    """The node-local directory of the server on `url` (one per user and port on a node)."""
    key = hashlib.sha256(url.encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"eagle3-sglang-{os.getuid()}-{key}"


@contextlib.contextmanager
def _locked(directory: Path):
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie (a supervisor this process started, not yet reaped) is not alive
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    return True


def _supervisor(directory: Path) -> dict | None:
    """The running supervisor's record (pid, command), or None."""
    with contextlib.suppress(OSError, ValueError):
        record = json.loads((directory / "supervisor.json").read_text())
        if pid_alive(record["pid"]):
            return record
    return None


def _live_users(directory: Path) -> list[int]:
    users = directory / "users"
    live = []
    for entry in users.glob("*") if users.is_dir() else []:
        if pid_alive(int(entry.name)):
            live.append(int(entry.name))
        else:
            entry.unlink(missing_ok=True)  # a job killed with -9
    return live


@contextlib.contextmanager
def shared_server(model_path: str | Path, url: str, launch: dict, log_path: str | Path):
    """The node's server for `url` for the duration of the block, started if none runs."""
    directory = state_dir(url)
    command = server_command(model_path, url, launch)
    me = directory / "users" / str(os.getpid())
    with _locked(directory):
        (directory / "stop").unlink(missing_ok=True)
        running = _supervisor(directory)
        if running and running["command"] != command:
            raise ServerError(
                f"an SGLang server with another command line already serves {url} on this node (supervisor pid "
                f"{running['pid']}: {' '.join(running['command'])}); use another inference.sglang.url"
            )
        me.parent.mkdir(exist_ok=True)
        me.touch()
        if running:
            log.info("using the SGLang server already running on this node (supervisor pid %s)", running["pid"])
        else:
            running = _start_supervisor(directory, model_path, url, launch, log_path)
    try:
        wait_healthy(
            url, launch.get("health_timeout", 1800), alive=lambda: pid_alive(running["pid"]), log_path=running["log"]
        )
        yield
    finally:
        me.unlink(missing_ok=True)


def _start_supervisor(directory: Path, model_path, url: str, launch: dict, log_path) -> dict:
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", __name__, "supervise", "--model-path", str(model_path), "--url", url]
    args += ["--launch", json.dumps(launch), "--log", str(Path(log_path).resolve())]
    with open(log_path, "ab") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    record = {"pid": process.pid, "command": server_command(model_path, url, launch), "log": str(log_path)}
    (directory / "supervisor.json").write_text(json.dumps(record))
    log.info("started the node's SGLang server supervisor (pid %s; the server's output: %s)", process.pid, log_path)
    return record


def request_stop(url: str) -> None:
    """Ask the node's server on `url` to stop as soon as no job uses it (no-op when none runs)."""
    directory = state_dir(url)
    if directory.is_dir() and _supervisor(directory):
        (directory / "stop").touch()


def release(url: str, timeout: float = 600) -> None:
    """Stop the node's server on `url` once no job uses it, and wait until it is gone (its GPUs free)."""
    directory = state_dir(url)
    request_stop(url)
    deadline = time.monotonic() + timeout
    while directory.is_dir() and _supervisor(directory):
        if time.monotonic() > deadline:
            raise ServerError(f"the SGLang server on {url} was still in use after {timeout} s")
        time.sleep(POLL_S)


def supervise(model_path: str, url: str, launch: dict, log_path: str) -> None:
    """Run the server while jobs use it; stop it after `idle_timeout` s without one, or when asked."""
    directory = state_dir(url)
    idle_timeout = launch.get("idle_timeout", 120)
    with contextlib.ExitStack() as stack:
        process = stack.enter_context(launched_server(model_path, url, launch, log_path))
        idle_since = time.monotonic()
        while process.poll() is None:
            if _live_users(directory):
                idle_since = time.monotonic()
            elif (directory / "stop").exists() or time.monotonic() - idle_since > idle_timeout:
                with _locked(directory):
                    if not _live_users(directory):  # none registered while the lock was free
                        log.info("no job uses the SGLang server; stopping it")
                        (directory / "stop").unlink(missing_ok=True)
                        stack.close()  # stopped with the lock held: a new job waits, then starts afresh
                        (directory / "supervisor.json").unlink(missing_ok=True)
                        return
            time.sleep(POLL_S)
    raise ServerError(f"the SGLang server exited with code {process.returncode}; see {log_path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    commands = p.add_subparsers(dest="command", required=True)
    run = commands.add_parser("supervise", help=supervise.__doc__)
    run.add_argument("--model-path", required=True)
    run.add_argument("--url", required=True)
    run.add_argument("--launch", type=json.loads, required=True)
    run.add_argument("--log", required=True)
    free = commands.add_parser("release", help=release.__doc__)
    free.add_argument("--url", required=True)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "release":
        release(args.url)
        return
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    supervise(args.model_path, args.url, args.launch, args.log)


if __name__ == "__main__":
    main()
