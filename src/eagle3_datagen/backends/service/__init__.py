"""One long-lived model process per node, shared by the jobs that run there: SGLang's generation
server for the responses shard jobs, the capture runner for the hidden-state shard jobs. Both have
one lifecycle and one readiness protocol (docs/design.md, "Node services").

A node holds one service at a time (both want the node's GPUs). The first job that needs it starts a
supervisor (`launch`), which runs the service's command and watches who uses it (`supervise`); every
job registers under a node-local lock and waits until the service's record (`record`) says it is
ready (`lease.using`). A job that needs another service (another kind, or the same kind with other
settings) asks the running one to stop, waits until no job uses it, then starts its own. The
supervisor stops its service once no registered job is alive for `idle_timeout` seconds, at once
when asked (`lease.request_stop`: the workflow's onsuccess/onerror where Snakemake runs on the node),
and on SIGTERM. A service on GPUs starts only once their memory is free (`gpus`: the processes of
the one before can hold it for a while after they were killed); one that fails to start leaves its
reason for its jobs (`record.record_failure`). A job killed with -9 counts as gone (its pid is dead),
so a rerun finds the service still up and uses it again. A service with a health URL that stops
answering it for `hang_timeout` seconds once ready (it accepts connections and never answers) is
taken as hung and killed; a service
that exits (or is killed) takes its record with it, so its jobs see it gone (`Lease.running`) and may
start a fresh one.

Nothing of this is in Snakemake's DAG: a service is no job's input or output, so adding a shard
reschedules no finished one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from eagle3_datagen.backends.base import ServerError


class ServiceError(ServerError):
    """The node's service did not start, exited, or stayed in use by other jobs."""


def launch_args(launch: dict) -> list[str]:
    """A launched server's `launch.args`, absent no flags: a schema default would change the params of every
    config without it."""
    return launch.get("args", [])


@dataclass(frozen=True)
class Service:
    """What a job needs running on its node."""

    name: str  # in messages and the log: "SGLang server", "capture runner"
    kind: str  # in its load records, as `plan.load_seconds` names it: "generation_server", "capture_runner"
    model: str  # the model it loads (an absolute path), in its load records
    key: str  # what identifies it: a job that needs another key replaces it once no job uses it
    command: list[str]
    log: str  # the service's output, and the supervisor's
    # from the stage's settings (the capture runner's load_timeout and idle_timeout, the server's launch)
    ready_timeout: float
    idle_timeout: float
    health_url: str | None = None  # ready when GET {health_url}/health answers 200; else when it marks itself loaded
    stop_timeout: float = 60.0  # SIGTERM to SIGKILL of its process group (the server's: launch.stop_timeout)
    hang_timeout: float | None = None  # once ready, killed as hung when its health URL is silent this long
    gpus: int = 0  # under SLURM, the GPUs its job step asks for
    # `resources.handover` (timeout, max_used_mib): with GPUs, it starts once their memory is free (`gpus`)
    handover: dict | None = None

    @classmethod
    def launched_server(
        cls, name: str, command: list[str], model: str | Path, url: str, launch: dict, log: str | Path,
        gpus: int = 0, handover: dict | None = None,
    ) -> Service:  # fmt: skip
        """A launched backend's server (`command` on `model` at `url`, with the schema's shared `launch`
        block) as the node's service for every shard job, started once the GPUs' memory is free
        (`handover`: `resources.handover`). Its key is its whole command line: a job that launches another
        replaces it."""
        return cls(
            name=name,
            kind="generation_server",
            model=str(Path(model).resolve()),
            key=json.dumps(command),
            command=command,
            log=str(log),
            health_url=url,
            ready_timeout=launch["health_timeout"],
            idle_timeout=launch["idle_timeout"],
            stop_timeout=launch["stop_timeout"],
            hang_timeout=launch["hang_timeout"],
            gpus=gpus,
            handover=handover,
        )
