"""One responses job: the configured backend over one or more prompt shards."""

from __future__ import annotations

import contextlib
import logging

from eagle3_datagen.backends.base import MissingApiKey, ServerError, ServerGone
from eagle3_datagen.formats.files import DiskFull, reporting_full_disk
from eagle3_datagen.stages.responses.conversation import run_responses
from eagle3_datagen.stages.responses.journaled import Budgets, IncompleteRun, run_journaled_responses

log = logging.getLogger(__name__)


class JobError(RuntimeError):
    """A job that stops with a message for the user (no traceback needed)."""


def budgets_from(settings: dict) -> Budgets:
    return Budgets(
        tokens=settings.get("token_budget"),
        cost_usd=(settings.get(settings["backend"]) or {}).get("max_cost_usd"),
    )


def run_response_job(
    shards: list[tuple[str, str, str]], settings: dict, server_log: str | None = None, run_settings: dict | None = None
) -> None:
    """`shards`: (prompts, out, stats) paths. `settings`: the job's response settings (the rule's merged
    with the run-only ones); `run_settings`: those run-only ones, recorded in each shard's stats."""
    model = settings["model"]
    backend = settings["backend"]
    provenance = {"run_settings": (run_settings or {}).get(backend) or {}}
    if backend == "hf":
        from eagle3_datagen.backends.hf.generate import HFBackend

        hf = HFBackend(model["path"], settings["sampling"], settings["hf"], model)
        try:
            for prompts, out, stats in shards:
                with reporting_full_disk(out):
                    run_responses(prompts, out, stats, hf, provenance)
        except DiskFull as e:
            raise JobError(str(e)) from None
        return
    pending = list(shards)
    restarts = ((settings.get("sglang") or {}).get("launch") or {}).get("max_service_restarts", 2)
    try:
        for restart in range(restarts + 1):
            with _server(settings, server_log, provenance) as lease:
                try:
                    while pending:
                        prompts, out, stats = pending[0]
                        backend = _api_backend(settings, lease.running if lease else None)
                        with reporting_full_disk(out):
                            result = run_journaled_responses(
                                prompts, out, stats, backend, budgets_from(settings), provenance=provenance
                            )
                        log.info("%s: %s", out, {k: result[k] for k in ("prompts", "status", "usage")})
                        pending.pop(0)
                    return
                except (IncompleteRun, ServerGone) as e:
                    if lease is None or lease.running():
                        raise
                    # The node's server died, or was killed as hung: transient (a CUDA error, an OOM kill).
                    died = f"{e}\nThe node's SGLang server exited during the shard (its log: {lease.log}):\n"
                    if restart == restarts:
                        raise JobError(
                            f"{died}{lease.log_tail()}\nIt exited {restarts + 1} times in this job "
                            f"(inference.sglang.launch.max_service_restarts={restarts}): fix the cause its log "
                            "names and rerun; the journal keeps every finished prompt"
                        ) from None
                    log.warning("%sstarting it again (restart %d of %d)", died, restart + 1, restarts)
    except (IncompleteRun, MissingApiKey, ServerError, ServerGone, DiskFull) as e:
        raise JobError(str(e)) from None


def _api_backend(settings: dict, server_alive=None):
    """`server_alive`: whether the SGLang server this job launched still runs (None: not launched here)."""
    if settings["backend"] == "sglang":
        from eagle3_datagen.backends.sglang.generate import SGLangBackend

        sglang = settings["sglang"]
        return SGLangBackend(settings["model"]["path"], settings["sampling"], sglang, settings["model"], server_alive)
    if settings["backend"] == "openrouter":
        from eagle3_datagen.backends.openrouter import OpenRouterBackend

        return OpenRouterBackend(settings["sampling"], settings["openrouter"])
    raise JobError(f"unknown inference backend {settings['backend']!r}")


def _server(settings: dict, server_log: str | None, provenance: dict):
    """The node's shared SGLang server when the config launches one (every shard job on the node uses it)."""
    sglang = settings.get("sglang") or {}
    if settings["backend"] != "sglang" or not sglang.get("launch"):
        return contextlib.nullcontext()
    from eagle3_datagen.backends.node_service import using
    from eagle3_datagen.backends.sglang.server import DEFAULT_URL, server_service

    url, model_path = sglang.get("url", DEFAULT_URL), settings["model"]["path"]
    launch, server_log = sglang["launch"], server_log or "sglang-server.log"
    service = server_service(model_path, url, launch, server_log, settings.get("gpus", 0))
    provenance["server_command"] = service.command
    return using(service)
