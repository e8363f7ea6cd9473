"""A job's side of the node's service: register with it (starting it if none runs), wait until its
record says it is ready, and leave it when done."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from eagle3_datagen.backends.service import Service, ServiceError, launch
from eagle3_datagen.backends.service.record import POLL_S, STOP, failure, locked, node_dir, running_record

log = logging.getLogger(__name__)

# How long a job waits for the node's other service to be left by its jobs before it gives up.
HANDOVER_TIMEOUT_S = 600


@dataclass
class Lease:
    """A job's use of the node's service, from `using`."""

    directory: Path
    token: str
    log: Path
    log_from: int = 0  # where this service's output starts in its log

    def record(self) -> dict | None:
        """The record of the service this job registered with, while it runs."""
        record = running_record(self.directory)
        return record if record is not None and record["token"] == self.token else None

    def running(self) -> bool:
        """Whether the service this job registered with still runs."""
        return self.record() is not None

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
        with locked(directory):
            running = running_record(directory)
            if running is None or running["key"] == service.key:
                (directory / STOP).unlink(missing_ok=True)
                if running is None:
                    running = launch.start(directory, service)
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


def _wait_ready(service: Service, lease: Lease) -> None:
    """Until the record says the service is ready (its supervisor alone probes it: `supervise.ready`); the
    supervisor first waits up to the handover's timeout for the GPUs' memory."""
    limit = service.ready_timeout + (service.handover["timeout"] if service.gpus and service.handover else 0)
    deadline = time.monotonic() + limit
    while (record := lease.record()) is not None:
        if "ready_s" in record:
            return
        if time.monotonic() > deadline:
            raise ServiceError(f"the {service.name} was not ready after {limit} s; see {lease.log}")
        time.sleep(POLL_S)
    if reason := failure(lease.directory, lease.token):
        raise ServiceError(f"{reason}\n(the node's {service.name}, {lease.log})")
    raise ServiceError(f"the node's {service.name} exited while starting ({lease.log}):\n{lease.log_tail()}")


def request_stop() -> None:
    """Ask the node's service to stop as soon as no job uses it (no-op when none runs)."""
    directory = node_dir()
    if directory.is_dir() and running_record(directory):
        (directory / STOP).touch()
