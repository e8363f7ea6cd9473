"""`sglang.launch_server`: its command line, its health check, the server for one block of one process
(`launched_server`: the GPU check) or shared by the node's shard jobs (`server_service`)."""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
from pathlib import Path
from urllib.parse import urlparse

from eagle3_datagen.backends.plugins import GENERATION
from eagle3_datagen.backends.service import Service
from eagle3_datagen.backends.service.supervise import process_group, wait_healthy

log = logging.getLogger(__name__)


def launch_args(launch: dict) -> list[str]:
    """`launch.args`, absent no flags: a schema default would change the params of every config without it."""
    return launch.get("args", [])


def server_command(model_path: str | Path, url: str, launch: dict) -> list[str]:
    parsed = urlparse(url)
    return [
        *GENERATION["sglang"].launch_command(launch, sys.executable),
        "--model-path",
        str(model_path),
        "--host",
        parsed.hostname or "127.0.0.1",
        "--port",
        str(parsed.port or 8000),
        *launch_args(launch),
        *launch["run_args"],
    ]


@contextlib.contextmanager
def launched_server(model_path: str | Path, url: str, launch: dict, log_path: str | Path):
    """Start `sglang.launch_server` for the duration of the block; stopped on exit or SIGTERM.

    The server runs in its own process group, so stopping it stops its tensor-parallel workers.
    """
    command = server_command(model_path, url, launch)
    log.info("starting the SGLang server: %s (its output: %s)", " ".join(command), log_path)
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(_signum, _frame):
        raise SystemExit("terminated; stopping the SGLang server")

    signal.signal(signal.SIGTERM, on_term)
    try:
        with (
            open(log_path, "ab") as server_log,
            process_group(command, server_log, launch["stop_timeout"]) as process,
        ):
            wait_healthy(url, launch["health_timeout"], lambda: process.poll() is None, log_path)
            yield process
    finally:
        signal.signal(signal.SIGTERM, previous)
        log.info("SGLang server stopped")


def service_for_job(settings: dict, server_log: str | None) -> Service:
    """The server a responses job's settings launch (plugins.GenerationBackend.service)."""
    sglang = settings["sglang"]
    log = server_log or "sglang-server.log"
    model_path, gpus, handover = settings["model"]["path"], settings["gpus"], settings["handover"]
    return server_service(model_path, sglang["url"], sglang["launch"], log, gpus, handover)


def server_service(
    model_path: str | Path, url: str, launch: dict, log_path: str | Path, gpus: int = 0, handover: dict | None = None
) -> Service:
    """The launched server as the node's shared service (`backends.service`): one per node for every shard
    job. The model's path is absolute: jobs of another workflow directory on the node do not share it."""
    model = Path(model_path).resolve()
    return Service.launched_server(
        "SGLang server", server_command(model, url, launch), model, url, launch, log_path, gpus, handover
    )
