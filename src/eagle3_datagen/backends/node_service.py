"""One long-lived model process per node, shared by the jobs that run there: SGLang's generation
server for the responses shard jobs, the capture runner for the hidden-state shard jobs.

A node holds one service at a time (both want the node's GPUs). The first job that needs it starts a
supervisor, which runs the service's command and watches who uses it; every job registers under a
node-local lock and waits until it is ready. A job that needs another service (another kind, or the
same kind with other settings) asks the running one to stop, waits until no job uses it, then starts
its own. The supervisor stops its service once no registered job is alive for `idle_timeout` seconds,
at once when asked (`request_stop`: the workflow's onsuccess/onerror where Snakemake runs on the
node), and on SIGTERM. A job killed with -9 counts as gone (its pid is dead), so a rerun finds the
service still up and uses it again. A service with a health URL that stops answering it for
`hang_timeout` seconds once ready (it accepts connections and never answers) is taken as hung and
killed; a service that exits (or is killed) takes its record with it, so its jobs see it gone
(`Lease.running`) and may start a fresh one.

Nothing of this is in Snakemake's DAG: a service is no job's input or output, so adding a shard
reschedules no finished one.

Inside a SLURM allocation the supervisor is started as a job step of its own (`srun --overlap`, on
this node, with the service's GPUs), which ends at the latest with the allocation. SLURM kills what a
job step leaves behind when the step ends (proctrack/cgroup) and cancels a step whose srun client is
gone, so the service outlives the job that started it only where that job runs in the allocation's
batch step: the GPU stages' jobs do, as jobs that launch their own processes, one per GPU
(`workflow.settings.cluster_job`). A job in a step of its own gets a service that ends with it. Each
allocation has its own node directory.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from eagle3_datagen.backends.base import ServerError
from eagle3_datagen.formats.files import write_json

log = logging.getLogger(__name__)

POLL_S = 0.5
# How long a job waits for the node's other service to be left by its jobs before it gives up.
HANDOVER_TIMEOUT_S = 600
# How often a ready service's health URL is asked whether it still answers (`hang_timeout`).
LIVENESS_INTERVAL_S = 5.0
# A service that has no health URL says it is ready by creating this file in the directory it is given.
SERVICE_DIR_ENV = "EAGLE3_DATAGEN_SERVICE_DIR"
LOADED = "loaded"
READY = "ready"
STOP = "stop"
RECORD = "supervisor.json"
# The job step's own settings that a nested srun would take as its defaults (the slurm-jobstep executor
# plugin clears them the same way for its srun); the allocation's identity stays.
SLURM_KEEP = {"SLURM_JOB_ID", "SLURM_JOBID", "SLURM_CLUSTER_NAME", "SLURM_CONF"}
SLURM_STEP_PREFIXES = ("SLURM_", "SRUN_", "SBATCH_")


class ServiceError(ServerError):
    """The node's service did not start, exited, or stayed in use by other jobs."""


@dataclass(frozen=True)
class Service:
    """What a job needs running on its node."""

    name: str  # in messages and the log: "SGLang server", "capture runner"
    key: str  # what identifies it: a job that needs another key replaces it once no job uses it
    command: list[str]
    log: str  # the service's output, and the supervisor's
    health_url: str | None = None  # ready when GET {health_url}/health answers 200; else when it writes LOADED
    ready_timeout: float = 1800.0
    idle_timeout: float = 120.0
    stop_timeout: float = 60.0
    hang_timeout: float | None = None  # once ready, killed as hung when its health URL is silent this long
    gpus: int = 0  # under SLURM, the GPUs its job step asks for


def node_dir() -> Path:
    """The node-local directory of this user's service (one per SLURM allocation)."""
    job = os.environ.get("SLURM_JOB_ID")
    return Path(tempfile.gettempdir()) / (f"eagle3-datagen-{os.getuid()}" + (f"-slurm{job}" if job else ""))


def log_path(base: str | Path) -> Path:
    """`base`, or under SLURM `base` with the allocation in its name: nodes do not write one file."""
    job = os.environ.get("SLURM_JOB_ID")
    base = Path(base)
    return base.with_name(f"{base.stem}.slurm-{job}{base.suffix}") if job else base


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
def _locked(directory: Path):
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _record(directory: Path) -> dict | None:
    """The running service's record (supervisor pid, service pid, token, ...), or None: none runs, or its
    process has exited and its supervisor is still cleaning up."""
    with contextlib.suppress(OSError, ValueError):
        record = json.loads((directory / RECORD).read_text())
        if pid_alive(record["pid"]) and pid_alive(record.get("service_pid", record["pid"])):
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


@dataclass
class Lease:
    """A job's use of the node's service, from `using`."""

    directory: Path
    token: str
    log: Path
    log_from: int = 0  # where this service's output starts in its log

    def running(self) -> bool:
        """Whether the service this job registered with still runs."""
        record = _record(self.directory)
        return record is not None and record["token"] == self.token

    def log_tail(self, chars: int = 3000) -> str:
        """The end of this service's output."""
        with contextlib.suppress(OSError), open(self.log, "rb") as f:
            f.seek(max(self.log_from, f.seek(0, os.SEEK_END) - chars))
            return f.read().decode(errors="replace")
        return ""


@contextlib.contextmanager
def using(service: Service) -> Iterator[Lease]:
    """The node's `service` for the duration of the block: started if none runs, or once the node's other
    service is no longer used; ready when the block starts."""
    directory = node_dir()
    me = directory / "users" / str(os.getpid())
    lease = _register(directory, service, me)
    try:
        _wait_ready(service, lease)
        yield lease
    finally:
        me.unlink(missing_ok=True)


def _register(directory: Path, service: Service, me: Path) -> Lease:
    deadline = time.monotonic() + HANDOVER_TIMEOUT_S
    waiting = False
    while True:
        with _locked(directory):
            running = _record(directory)
            if running is None or running["key"] == service.key:
                (directory / STOP).unlink(missing_ok=True)
                if running is None:
                    running = _start(directory, service)
                else:
                    log.info("using the %s already running on this node (%s)", service.name, running["where"])
                me.parent.mkdir(exist_ok=True)
                me.touch()
                return Lease(directory, running["token"], Path(running["log"]), running.get("log_from", 0))
            # Another service holds the node: it stops once no job uses it (re-asked each time, since a
            # job that registers with it cancels a pending stop).
            (directory / STOP).touch()
            if not waiting:
                log.info("the node runs the %s; starting the %s once no job uses it", running["name"], service.name)
                waiting = True
        if time.monotonic() > deadline:
            raise ServiceError(
                f"the {running['name']} on this node was still in use after {HANDOVER_TIMEOUT_S} s; "
                f"another run may be using the node ({directory})"
            )
        time.sleep(POLL_S)


def _start(directory: Path, service: Service) -> dict:
    """Start a supervisor for `service` (the node lock held) and record it."""
    for stale in (READY, LOADED):
        (directory / stale).unlink(missing_ok=True)
    token = uuid.uuid4().hex
    output = log_path(service.log).resolve()
    output.parent.mkdir(parents=True, exist_ok=True)
    service = replace(service, log=str(output))
    log_from = output.stat().st_size if output.exists() else 0
    command = [sys.executable, "-m", __name__, "supervise", "--token", token, "--service", json.dumps(asdict(service))]
    launcher, env = _slurm_step(service), None
    if launcher:
        env = {k: v for k, v in os.environ.items() if k in SLURM_KEEP or not k.startswith(SLURM_STEP_PREFIXES)}
    with open(output, "ab") as out:
        process = subprocess.Popen(
            [*launcher, *command], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, env=env,
        )  # fmt: skip
    # The starter's pid until the supervisor writes its own (under SLURM, the starter is the srun client).
    record = {"pid": process.pid, "token": token, "key": service.key, "name": service.name}
    record |= {"log": str(output), "log_from": log_from, "where": where()}
    write_json(directory / RECORD, record)
    log.info("starting the node's %s (its output: %s)", service.name, output)
    return record


def _slurm_step(service: Service) -> list[str]:
    """Inside a SLURM allocation, an srun command that starts the supervisor as a job step of its own on
    this node, sharing the allocation's CPUs, memory and GPUs with the shard jobs."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job or shutil.which("srun") is None:
        return []
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    step = ["srun", "--overlap", f"--jobid={job}", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--mem=0"]
    if cpus := os.environ.get("SLURM_CPUS_ON_NODE"):
        step.append(f"--cpus-per-task={cpus}")
    if service.gpus:
        step.append(f"--gpus={service.gpus}")
    # The step writes its output to the service's log itself, on the node: nothing goes through the srun
    # client.
    output = ["--input=none", f"--output={service.log}", f"--error={service.log}", "--open-mode=append"]
    return [*step, *output, f"--job-name={service.name.replace(' ', '-')}"]


def _wait_ready(service: Service, lease: Lease) -> None:
    deadline = time.monotonic() + service.ready_timeout
    while True:
        if not lease.running():
            raise ServiceError(f"the node's {service.name} exited while starting ({lease.log}):\n{lease.log_tail()}")
        with contextlib.suppress(OSError):
            if (lease.directory / READY).read_text() == lease.token:
                return
        if time.monotonic() > deadline:
            raise ServiceError(f"the {service.name} was not ready after {service.ready_timeout} s; see {lease.log}")
        time.sleep(POLL_S)


def request_stop() -> None:
    """Ask the node's service to stop as soon as no job uses it (no-op when none runs)."""
    directory = node_dir()
    if directory.is_dir() and _record(directory):
        (directory / STOP).touch()


def mark_loaded() -> None:
    """Called by a service without a health URL (in the process its supervisor started) once it is ready."""
    (Path(os.environ[SERVICE_DIR_ENV]) / LOADED).touch()


def healthy(url: str, timeout: float = 5.0) -> bool:
    """Whether the HTTP server at `url` answers GET /health with 200 within `timeout` s."""
    with contextlib.suppress(OSError), urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout) as response:
        return response.status == 200
    return False


class _Liveness(threading.Thread):
    """Asks a ready service's health URL every LIVENESS_INTERVAL_S s, beside the supervisor's loop (a
    hung server holds each question up to its timeout); `silent_for` is the time since it last answered."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url = url
        self.answered = time.monotonic()

    def run(self) -> None:
        while True:
            # longer than SGLang's own health check waits for its scheduler (20 s) before it says 503
            if healthy(self.url, timeout=30):
                self.answered = time.monotonic()
            time.sleep(LIVENESS_INTERVAL_S)

    def silent_for(self) -> float:
        return time.monotonic() - self.answered


def _ready(service: Service, directory: Path) -> bool:
    return (directory / LOADED).exists() if service.health_url is None else healthy(service.health_url)


@contextlib.contextmanager
def process_group(command: list[str], output, stop_timeout: float, env: dict | None = None):
    """`command` in a process group of its own for the duration of the block, then stopped: SIGTERM to
    the whole group (a server's or torchrun's workers too), SIGKILL after `stop_timeout` s. A group whose
    leader died first (kill -9, an OOM kill) is killed whole: its workers would hold the port and GPUs."""
    process = subprocess.Popen(
        command, stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=env
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=stop_timeout)
            except subprocess.TimeoutExpired:
                process.kill()
        # The group's id is its leader's pid, never reused while a member lives.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def supervise(service: Service, token: str) -> None:
    """Run `service` while jobs use it; stop it after `idle_timeout` s without one, when asked, or on SIGTERM.

    It is stopped with the node lock held and its record removed before the lock is free again, so a job
    never registers with a service that is going away, and a new one starts only once the old one is gone.
    """
    directory = node_dir()
    with _locked(directory):
        if not _update_record(directory, token, pid=os.getpid(), where=where()):
            return  # replaced while this step was starting
    started = time.monotonic()
    log.info("starting the %s on %s: %s", service.name, where(), " ".join(service.command))
    running = contextlib.ExitStack()
    try:
        output = running.enter_context(open(service.log, "ab"))  # noqa: SIM115 - closed by the ExitStack
        env = {**os.environ, SERVICE_DIR_ENV: str(directory)}
        process = running.enter_context(process_group(service.command, output, service.stop_timeout, env))
        with _locked(directory):
            _update_record(directory, token, service_pid=process.pid)
        _serve(service, directory, token, process, started, running)
    finally:
        with _locked(directory):
            _stop(directory, token, running)
    log.info("%s stopped", service.name)


def _stop(directory: Path, token: str, running: contextlib.ExitStack) -> None:
    """Stop the service (a no-op once stopped) and remove its record; the caller holds the node lock."""
    running.close()
    if _record_of(directory, token) is not None:
        for name in (RECORD, READY, LOADED):
            (directory / name).unlink(missing_ok=True)


def _update_record(directory: Path, token: str, **fields) -> bool:
    """Add `fields` to the record of the service `token`; False when another's record replaced it. The
    caller holds the node lock; jobs read the record without it, so it is replaced whole, never rewritten
    in place."""
    record = _record_of(directory, token)
    if record is not None:
        write_json(directory / RECORD, record | fields)
    return record is not None


def _record_of(directory: Path, token: str) -> dict | None:
    with contextlib.suppress(OSError, ValueError):
        record = json.loads((directory / RECORD).read_text())
        if record["token"] == token:
            return record
    return None


def _serve(service: Service, directory: Path, token: str, process, started: float, running) -> None:
    ready = False
    idle_since = time.monotonic()
    liveness = None
    waiting_to_stop = False
    while process.poll() is None:
        if not ready and _ready(service, directory):
            ready = True
            log.info("%s ready after %.1f s", service.name, time.monotonic() - started)
            (directory / READY).write_text(token)
            if service.health_url and service.hang_timeout:
                liveness = _Liveness(service.health_url)
                liveness.start()
        elif not ready and time.monotonic() - started > service.ready_timeout:
            raise ServiceError(f"the {service.name} was not ready after {service.ready_timeout} s")
        if liveness is not None and liveness.silent_for() > service.hang_timeout:
            # SIGKILL, not SIGTERM: a stopped process would hold a SIGTERM until it runs again.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise ServiceError(
                f"the {service.name} did not answer {service.health_url}/health for {liveness.silent_for():.0f} s "
                f"(hang_timeout {service.hang_timeout} s): taken as hung and killed; see {service.log}"
            )
        stop_asked = (directory / STOP).exists()
        if _live_users(directory):
            idle_since = time.monotonic()
            if stop_asked and not waiting_to_stop:
                log.info("a stop was asked; the %s stops once no job uses it", service.name)
            waiting_to_stop = stop_asked
        elif stop_asked or time.monotonic() - idle_since > service.idle_timeout:
            with _locked(directory):
                if not _live_users(directory):  # none registered while the lock was free
                    log.info("no job uses the %s; stopping it", service.name)
                    (directory / STOP).unlink(missing_ok=True)
                    _stop(directory, token, running)
                    return
        time.sleep(POLL_S)
    raise ServiceError(f"the {service.name} exited with code {process.returncode}; see {service.log}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    commands = p.add_subparsers(dest="command", required=True)
    run = commands.add_parser("supervise", help=supervise.__doc__)
    run.add_argument("--service", type=json.loads, required=True, help="the Service as JSON")
    run.add_argument("--token", required=True, help="the record this supervisor takes over")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGHUP, signal.SIG_IGN)

    def on_term(_signum, _frame):
        raise SystemExit("terminated; stopping the service")

    signal.signal(signal.SIGTERM, on_term)
    supervise(Service(**args.service), args.token)


if __name__ == "__main__":
    main()
