"""A local `sglang.launch_server` for the duration of a job, and its health check."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

from eagle3_datagen.backends.base import ServerError

log = logging.getLogger(__name__)

DEFAULT_URL = "http://localhost:8000"


def wait_healthy(
    url: str, timeout: float, alive: Callable[[], bool] | None = None, log_path: str | Path | None = None
) -> None:
    """Poll `/health` until the server answers 200; fail at once if `alive` (of a server we started) turns false.

    The one health check: the job that launches a server and the backend that waits for one both use it.
    """
    deadline = time.monotonic() + timeout
    while alive is None or alive():
        with contextlib.suppress(OSError), urllib.request.urlopen(url.rstrip("/") + "/health", timeout=5) as resp:
            if resp.status == 200:
                log.info("SGLang server healthy at %s", url)
                return
        if time.monotonic() > deadline:
            see = f"; see {log_path}" if log_path else ""
            raise ServerError(f"no healthy SGLang server at {url} after {timeout} s{see}")
        time.sleep(1.0)
    tail = Path(log_path).read_text(errors="replace")[-2000:] if log_path else ""
    raise ServerError(f"the SGLang server exited while starting:\n{tail}")


def server_command(model_path: str | Path, url: str, launch: dict) -> list[str]:
    parsed = urlparse(url)
    return [
        *launch.get("command", [sys.executable, "-m", "sglang.launch_server"]),
        "--model-path",
        str(model_path),
        "--host",
        parsed.hostname or "127.0.0.1",
        "--port",
        str(parsed.port or 8000),
        *launch.get("args", []),
        *launch.get("run_args", []),
    ]


@contextlib.contextmanager
def launched_server(model_path: str | Path, url: str, launch: dict, log_path: str | Path):
    """Start `sglang.launch_server` for the duration of the block; stopped on exit or SIGTERM.

    The server runs in its own process group, so stopping it stops its tensor-parallel workers.
    """
    command = server_command(model_path, url, launch)
    log.info("starting the SGLang server: %s (its output: %s)", " ".join(command), log_path)
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    server_log = open(log_path, "ab")  # noqa: SIM115 - closed in finally, after the server
    process = subprocess.Popen(command, stdout=server_log, stderr=subprocess.STDOUT, start_new_session=True)
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(_signum, _frame):
        raise SystemExit(f"terminated; stopping the SGLang server (pid {process.pid})")

    signal.signal(signal.SIGTERM, on_term)
    try:
        wait_healthy(url, launch.get("health_timeout", 1800), lambda: process.poll() is None, log_path)
        yield process
    finally:
        signal.signal(signal.SIGTERM, previous)
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=launch.get("stop_timeout", 60))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        server_log.close()
        log.info("SGLang server stopped (exit code %s)", process.returncode)
