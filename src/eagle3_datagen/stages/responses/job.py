"""One responses job: the configured backend over one or more prompt shards."""

from __future__ import annotations

import contextlib
import logging

from eagle3_datagen.backends.base import MissingApiKey, ServerError, ServerGone
from eagle3_datagen.backends.ledger import Ledger, LedgerError
from eagle3_datagen.formats.files import DiskFull, reporting_full_disk
from eagle3_datagen.stages.responses.journaled import Budgets, IncompleteRun, run_journaled_responses

log = logging.getLogger(__name__)


class JobError(RuntimeError):
    """A job that stops with a message for the user (no traceback needed)."""


def budgets_from(settings: dict) -> Budgets:
    return Budgets(
        tokens=settings.get("token_budget"),
        cost_usd=(settings.get(settings["backend"]) or {}).get("max_cost_usd"),
    )


def ledger_for(settings: dict, backend, out: str) -> Ledger | None:
    """The endpoint's run-wide ledger for the shard `out`, where the workflow keeps one (`ledger_dir`): it
    shares OpenRouter's concurrency, and every backend's budgets and stop; None where there is nothing to
    share (SGLang and hf without a token budget: their concurrency is their server's or process's)."""
    directory = settings.get("ledger_dir")  # absent: a shard answered outside the workflow
    if directory is None:
        return None
    if settings["backend"] == "openrouter":
        return Ledger(directory, backend.name, backend.model, out, backend.concurrency)
    if budgets_from(settings).any:
        return Ledger(directory, backend.name, backend.model, out, None)
    return None


def run_response_job(
    shards: list[tuple[str, str, str]], settings: dict, server_log: str | None = None, run_settings: dict | None = None
) -> None:
    """`shards`: (prompts, out, stats) paths. `settings`: the job's response settings (the rule's merged
    with the run-only ones); `run_settings`: those run-only ones, recorded in each shard's stats."""
    if settings["backend"] == "dataset":  # the records' own turns: no model, no journal, no budget
        from eagle3_datagen.stages.responses.original import original_responses, think_tokens

        think = think_tokens(settings["model"])
        for prompts, out, stats in shards:
            with reporting_full_disk(out):
                original_responses(prompts, out, stats, settings["dataset"], think)
        return
    provenance = {"run_settings": (run_settings or {}).get(settings["backend"]) or {}}
    launch = settings["sglang"].get("launch") if settings["backend"] == "sglang" else None
    restarts = launch["max_service_restarts"] if launch else 0
    pending = list(shards)
    try:
        # hf's model loads once for every shard; an HTTP backend's session and slots belong to one
        # event loop (one shard's), so each shard gets its own.
        shared = _backend(settings) if settings["backend"] == "hf" else None
        for restart in range(restarts + 1):
            with _server(settings, server_log, provenance) as lease:
                try:
                    while pending:
                        prompts, out, stats = pending[0]
                        backend = shared or _backend(settings, lease.running if lease else None)
                        with reporting_full_disk(out):
                            result = run_journaled_responses(
                                prompts,
                                out,
                                stats,
                                backend,
                                budgets_from(settings),
                                provenance=provenance,
                                ledger=ledger_for(settings, backend, out),
                                max_failed_rate=settings["max_failed_rate"],
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
    except (IncompleteRun, MissingApiKey, ServerError, ServerGone, DiskFull, LedgerError) as e:
        raise JobError(str(e)) from None


def _backend(settings: dict, server_alive=None):
    """`server_alive`: whether the SGLang server this job launched still runs (None: not launched here)."""
    if settings["backend"] == "hf":
        from eagle3_datagen.backends.hf.generate import HFBackend

        return HFBackend(settings["model"]["path"], settings["sampling"], settings["hf"], settings["model"])
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
    if settings["backend"] != "sglang" or "launch" not in settings["sglang"]:
        return contextlib.nullcontext()
    from eagle3_datagen.backends.service.lease import using
    from eagle3_datagen.backends.sglang.server import server_service

    sglang = settings["sglang"]
    url, model_path = sglang["url"], settings["model"]["path"]
    launch, server_log = sglang["launch"], server_log or "sglang-server.log"
    service = server_service(model_path, url, launch, server_log, settings["gpus"], settings["handover"])
    provenance["server_command"] = service.command
    return using(service)
