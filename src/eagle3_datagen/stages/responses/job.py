"""One responses job: the configured backend over one or more prompt shards."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from eagle3_datagen.backends.base import MissingApiKey, ServerError, ServerGone
from eagle3_datagen.backends.ledger import Ledger, LedgerError
from eagle3_datagen.backends.plugins import GENERATION, GenerationBackend
from eagle3_datagen.formats.files import DiskFull, read_jsonl, reporting_full_disk
from eagle3_datagen.stages.responses.journaled import Budgets, IncompleteRun, run_journaled_responses

log = logging.getLogger(__name__)


class JobError(RuntimeError):
    """A job that stops with a message for the user (no traceback needed)."""


def budgets_from(settings: dict) -> Budgets:
    section = settings.get(settings["backend"]) or {}
    return Budgets(
        tokens=settings.get("token_budget"),
        cost_usd=section.get("max_cost_usd"),
        prices=section.get("price_per_million"),
    )


def ledger_for(settings: dict, backend, out: str) -> Ledger | None:
    """The endpoint's run-wide ledger for the shard `out`, where the workflow keeps one (`ledger_dir`): it
    shares OpenRouter's concurrency, and every backend's budgets and stop; None where there is nothing to
    share (SGLang and hf without a token budget: their concurrency is their server's or process's)."""
    directory = settings.get("ledger_dir")  # absent: a shard answered outside the workflow
    if directory is None:
        return None
    results = Path(out).parents[2]  # results/<partition>/responses/<shard>
    if GENERATION[settings["backend"]].priced:
        return Ledger(directory, backend.name, backend.model, out, backend.concurrency, results)
    if budgets_from(settings).any:
        return Ledger(directory, backend.name, backend.model, out, None, results)
    return None


def server_share(lease, backend, out: str) -> Ledger | None:
    """The concurrency of the node's launched server, shared by the shard jobs that use it at once
    (the launched backend's `launch.shard_jobs`): a ledger in the node's own directory, oldest job first, so a
    shard runs at the server's full batch and its tail of long answers leaves the rest to the next shard.
    None without a launched server (its concurrency is the job's own)."""
    if lease is None:
        return None
    clients = lease.directory / "clients"
    return Ledger(clients, backend.name, backend.model, out, backend.concurrency, lease.directory, oldest_first=True)


def run_response_job(
    shards: list[tuple[str, str, str]], settings: dict, server_log: str | None = None, run_settings: dict | None = None
) -> None:
    """`shards`: (prompts, out, stats) paths. `settings`: the job's response settings (the rule's merged
    with the run-only ones); `run_settings`: those run-only ones, recorded in each shard's stats."""
    entry = GENERATION[settings["backend"]]
    if entry.implementation is None:  # the records' own turns: no model, no journal, no budget
        from eagle3_datagen.stages.responses.original import original_responses, think_tokens

        think = think_tokens(settings["model"])
        for prompts, out, stats in shards:
            with reporting_full_disk(out):
                original_responses(prompts, out, stats, settings["dataset"], think)
        return
    provenance = {"run_settings": (run_settings or {}).get(settings["backend"]) or {}}
    launch = settings[entry.name].get("launch") if entry.node_service(settings.get(entry.name) or {}) else None
    restarts = launch["max_service_restarts"] if launch else 0
    pending = list(shards)
    try:
        # hf's model loads once for every shard; an HTTP backend's session and slots belong to one
        # event loop (one shard's), so each shard gets its own.
        shared = entry.build(settings) if entry.in_process else None
        for restart in range(restarts + 1):
            with _server(entry, settings, server_log, provenance) as lease:
                try:
                    while pending:
                        prompts, out, stats = pending[0]
                        backend = shared or entry.build(settings, lease.running if lease else None)
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
                                share=server_share(lease, backend, out),
                            )
                            if hasattr(backend, "finish_shard"):  # e.g. vLLM's one pass: its staged states
                                backend.finish_shard(read_jsonl(out), out)
                        log.info("%s: %s", out, {k: result[k] for k in ("prompts", "status", "failures", "usage")})
                        pending.pop(0)
                    return
                except (IncompleteRun, ServerGone) as e:
                    if lease is None or lease.running():
                        raise
                    # The node's server died, or was killed as hung: transient (a CUDA error, an OOM kill).
                    died = f"{e}\nThe node's {entry.label} server exited during the shard (its log: {lease.log}):\n"
                    if restart == restarts:
                        raise JobError(
                            f"{died}{lease.log_tail()}\nIt exited {restarts + 1} times in this job "
                            f"({entry.section}.launch.max_service_restarts={restarts}): fix the cause its log "
                            "names and rerun; the journal keeps every finished prompt"
                        ) from None
                    log.warning("%sstarting it again (restart %d of %d)", died, restart + 1, restarts)
    except (IncompleteRun, MissingApiKey, ServerError, ServerGone, DiskFull, LedgerError) as e:
        raise JobError(str(e)) from None


def _server(entry: GenerationBackend, settings: dict, server_log: str | None, provenance: dict):
    """The node's shared server when the config launches one (every shard job on the node uses it)."""
    service = entry.launched_service(settings, server_log)
    if service is None:
        return contextlib.nullcontext()
    from eagle3_datagen.backends.service.lease import using

    provenance["server_command"] = service.command
    return using(service)
