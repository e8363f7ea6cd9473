"""`sglang.launch_server` for one block of one process (`launched_server`: the GPU check and the evaluate
stage's speculative decoding); the node's shared server is its registry entry's `launched_service`."""

from __future__ import annotations

import contextlib
import logging
import signal
from pathlib import Path

from eagle3_datagen.backends.plugins import GENERATION
from eagle3_datagen.backends.service.supervise import process_group, wait_healthy

log = logging.getLogger(__name__)


@contextlib.contextmanager
def launched_server(model_path: str | Path, url: str, launch: dict, log_path: str | Path):
    """Start `sglang.launch_server` for the duration of the block; stopped on exit or SIGTERM.

    The server runs in its own process group, so stopping it stops its tensor-parallel workers.
    """
    command = GENERATION["sglang"].server_command(model_path, url, launch)
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
