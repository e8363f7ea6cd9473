"""The supervisor of a node's service: waits for the GPUs' memory, runs its command in a process group,
says when it is ready, records each load, watches a ready server for a hang, and stops it when no job
uses it.

Readiness is probed the same way for every service (`ready`): GET {health_url}/health for a server,
the `loaded` mark for a process without one. Once the probe passes, the supervisor (the only one that
probes) writes `ready_s` into the service's record, which is what every job waits on, and appends a
load record (`formats/service_loads.py`) for the plan.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from eagle3_datagen.backends.base import ServerError
from eagle3_datagen.backends.service import Service, ServiceError
from eagle3_datagen.backends.service.gpus import wait_for_free_memory
from eagle3_datagen.backends.service.record import (
    LOADED,
    POLL_S,
    SERVICE_DIR_ENV,
    STOP,
    live_users,
    locked,
    node_dir,
    record_failure,
    remove_record,
    update_record,
    where,
)
from eagle3_datagen.formats.service_loads import append_load

log = logging.getLogger(__name__)

# How often a ready service's health URL is asked whether it still answers (`hang_timeout`).
LIVENESS_INTERVAL_S = 5.0


def healthy(url: str, timeout: float = 5.0) -> bool:
    """Whether the HTTP server at `url` answers GET /health with 200 within `timeout` s."""
    with contextlib.suppress(OSError), urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout) as response:
        return response.status == 200
    return False


def wait_healthy(
    url: str, timeout: float, alive: Callable[[], bool] | None = None, log_path: str | Path | None = None
) -> None:
    """Poll `/health` until the server answers 200; fail at once if `alive` (of a server we started) turns false.

    The one health check: the job that launches a server and the backend that waits for one both use it.
    """
    deadline = time.monotonic() + timeout
    while alive is None or alive():
        if healthy(url):
            log.info("server healthy at %s", url)
            return
        if time.monotonic() > deadline:
            see = f"; see {log_path}" if log_path else ""
            raise ServerError(f"no healthy server at {url} after {timeout} s{see}")
        time.sleep(1.0)
    tail = Path(log_path).read_text(errors="replace")[-2000:] if log_path else ""
    raise ServerError(f"the server exited while starting:\n{tail}")


def ready(service: Service, directory) -> bool:
    """The readiness probe: the health URL answers, or (none) the service marked itself loaded."""
    return (directory / LOADED).exists() if service.health_url is None else healthy(service.health_url)


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


def supervise(service: Service, token: str, loads: str) -> None:
    """Run `service` while jobs use it; stop it after `idle_timeout` s without one, when asked, or on SIGTERM.
    Each load is appended to `loads`.

    It is stopped with the node lock held and its record removed before the lock is free again, so a job
    never registers with a service that is going away, and a new one starts only once the old one is gone.
    """
    directory = node_dir()
    with locked(directory):
        if not update_record(directory, token, pid=os.getpid(), where=where()):
            return  # replaced while this step was starting
    running = contextlib.ExitStack()
    try:
        if service.gpus and service.handover:
            wait_for_free_memory(service.handover["timeout"], service.handover["max_used_mib"], service.name)
        started = time.monotonic()  # the load's seconds leave the wait out
        log.info("starting the %s on %s: %s", service.name, where(), " ".join(service.command))
        output = running.enter_context(open(service.log, "ab"))  # noqa: SIM115 - closed by the ExitStack
        env = {**os.environ, SERVICE_DIR_ENV: str(directory)}
        process = running.enter_context(process_group(service.command, output, service.stop_timeout, env))
        with locked(directory):
            update_record(directory, token, service_pid=process.pid)
        _serve(service, directory, token, process, started, running, loads)
    except ServiceError as e:
        record_failure(directory, token, str(e))
        raise
    finally:
        with locked(directory):
            running.close()
            remove_record(directory, token)
    log.info("%s stopped", service.name)


def _mark_ready(service: Service, directory, token: str, seconds: float, loads: str) -> None:
    log.info("%s ready after %.1f s", service.name, seconds)
    try:
        append_load(loads, service.kind, service.model, seconds, socket.gethostname())
    except OSError as e:  # the plan then assumes plan.load_seconds; the jobs need the service, not the record
        log.warning("could not record the load in %s: %s", loads, e)
    with locked(directory):
        update_record(directory, token, ready_s=round(seconds, 1))


def _serve(service: Service, directory, token: str, process, started: float, running, loads: str) -> None:
    is_ready = False
    idle_since = time.monotonic()
    liveness = None
    waiting_to_stop = False
    while process.poll() is None:
        if not is_ready and ready(service, directory):
            is_ready = True
            _mark_ready(service, directory, token, time.monotonic() - started, loads)
            if service.health_url and service.hang_timeout:
                liveness = _Liveness(service.health_url)
                liveness.start()
        elif not is_ready and time.monotonic() - started > service.ready_timeout:
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
        if live_users(directory):
            idle_since = time.monotonic()
            if stop_asked and not waiting_to_stop:
                log.info("a stop was asked; the %s stops once no job uses it", service.name)
            waiting_to_stop = stop_asked
        elif stop_asked or time.monotonic() - idle_since > service.idle_timeout:
            with locked(directory):
                if not live_users(directory):  # none registered while the lock was free
                    log.info("no job uses the %s; stopping it", service.name)
                    (directory / STOP).unlink(missing_ok=True)
                    running.close()
                    remove_record(directory, token)
                    return
        time.sleep(POLL_S)
    raise ServiceError(f"the {service.name} exited with code {process.returncode}; see {service.log}")


def main() -> None:
    p = argparse.ArgumentParser(description=supervise.__doc__.split("\n", 1)[0])
    p.add_argument("--service", type=json.loads, required=True, help="the Service as JSON")
    p.add_argument("--token", required=True, help="the record this supervisor takes over")
    p.add_argument("--loads", required=True, help="the file its load records are appended to")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGHUP, signal.SIG_IGN)

    def on_term(_signum, _frame):
        raise SystemExit("terminated; stopping the service")

    signal.signal(signal.SIGTERM, on_term)
    supervise(Service(**args.service), args.token, args.loads)


if __name__ == "__main__":
    main()
