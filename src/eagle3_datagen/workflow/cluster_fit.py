"""Before any SLURM submission: does every job's request fit some node of its partition, and may its
account and QoS be used there?

`sbatch` accepts a job that asks for more CPUs than any node of its partition has, and the job
then pends forever (`Reason=PartitionConfig`): the workflow hangs instead of failing. An account or a
QoS that is not the user's fails the job's submission, which for a GPU stage comes hours into the run,
after every CPU job before it. The workflow's `onstart` hook (executor `slurm` only) compares each
scheduled job's request with `sinfo`'s nodes and `sacctmgr`'s associations of the user, and stops with
a message naming the rule, the request and the config key to fix. The executor plugin has no such
check: its `--slurm-partition-config` only picks a partition, and it checks an account only when it
submits a job that names one.
"""

from __future__ import annotations

import getpass
import re
import shutil
import subprocess
from dataclasses import dataclass, field

SINFO_FORMAT = "%P|%c|%m|%G|%l"


class UnsatisfiableRequest(RuntimeError):
    pass


@dataclass(frozen=True)
class Node:
    partition: str
    cpus: int
    mem_mb: int
    gpus: int
    max_minutes: int | None  # None: no time limit
    default: bool = False


@dataclass(frozen=True)
class Request:
    name: str  # what is submitted: "rule NAME", or "group NAME (...)" for a group job
    partition: str | None  # None: the cluster's default partition
    cpus: int
    mem_mb: int
    runtime: int  # minutes
    gpus: int
    account: str | None = None  # None: none asked for
    qos: str | None = None


@dataclass(frozen=True)
class Association:
    """What sacctmgr lets the user submit under: an account, on a partition (None: any), with these QoS."""

    account: str
    partition: str | None
    qos: frozenset[str] = field(default_factory=frozenset)


def scheduled_requests(dag) -> list[Request]:
    """What each submission of Snakemake's `dag` asks SLURM for (a job, or a group job: one sbatch for its
    jobs), read as the slurm executor plugin reads it."""
    submissions = {}
    for job in dag.needrun_jobs():
        submitted = dag.get_job_group(job) or job
        submissions[id(submitted)] = submitted
    return [
        Request(
            name=f"group {job.groupid} ({len(job.jobs)} jobs)" if job.is_group() else f"rule {job.rule.name}",
            partition=job.resources.get("slurm_partition"),
            cpus=(job.resources.get("cpus_per_task") or job.threads) * job.resources.get("tasks_per_node", 1),
            mem_mb=job.resources.get("mem_mb", 0),
            runtime=job.resources.get("runtime", 0),
            gpus=job.resources.get("gpu", 0),
            account=job.resources.get("slurm_account"),
            qos=job.resources.get("qos"),
        )
        for job in submissions.values()
    ]


def gres_gpus(gres: str) -> int:
    """GPUs in a `sinfo %G` field such as `gpu:8`, `gpu:h200:8(S:0-1)` or `(null)`."""
    return sum(int(m) for m in re.findall(r"(?:^|,)gpu(?::[^:,(]+)?:(\d+)", gres))


def minutes(limit: str) -> int | None:
    """A SLURM time limit (`infinite`, `MM`, `MM:SS`, `HH:MM:SS`, `D-HH[:MM[:SS]]`) in minutes."""
    if limit in ("infinite", "UNLIMITED"):
        return None
    days, _, clock = limit.rpartition("-")
    parts = [int(x) for x in clock.split(":")]
    if days:
        hours, mins = (parts + [0, 0])[:2]
    elif len(parts) == 3:
        hours, mins = parts[:2]
    else:  # MM or MM:SS
        hours, mins = 0, parts[0]
    return int(days or 0) * 1440 + hours * 60 + mins


def parse_sinfo(text: str) -> list[Node]:
    """Nodes from `sinfo --noheader --Node --format` with SINFO_FORMAT (`*` marks the default)."""
    nodes = []
    for line in text.splitlines():
        if not line.strip():
            continue
        partition, cpus, mem, gres, limit = line.strip().split("|")
        nodes.append(
            Node(
                partition=partition.rstrip("*"),
                cpus=int(cpus),
                mem_mb=int(mem.rstrip("+")),
                gpus=gres_gpus(gres),
                max_minutes=minutes(limit),
                default=partition.endswith("*"),
            )
        )
    return nodes


def read_nodes() -> list[Node]:
    out = subprocess.run(
        ["sinfo", "--noheader", "--Node", f"--format={SINFO_FORMAT}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return parse_sinfo(out)


def parse_associations(text: str) -> list[Association]:
    """Associations from `sacctmgr -n -P show assoc user=USER format=account,partition,qos`."""
    found = []
    for line in text.splitlines():
        if line.strip():
            account, partition, qos = line.strip().split("|")
            found.append(Association(account, partition or None, frozenset(q for q in qos.split(",") if q)))
    return found


def read_associations() -> list[Association] | None:
    """The user's associations; None where the cluster keeps none (no sacctmgr, or no accounting): then
    nothing is checked."""
    if shutil.which("sacctmgr") is None:
        return None
    out = subprocess.run(
        ["sacctmgr", "-n", "-P", "show", "assoc", f"user={getpass.getuser()}", "format=account,partition,qos"],
        capture_output=True,
        text=True,
    )
    return (parse_associations(out.stdout) or None) if out.returncode == 0 else None


def association_problem(request: Request, partition: str | None, associations: list[Association]) -> str | None:
    """Why the request's account or QoS cannot be used on its partition, or None."""
    if request.account is None and request.qos is None:
        return None
    usable = [a for a in associations if a.partition in (None, partition)]
    if request.account is not None:
        accounts = sorted({a.account for a in usable})
        usable = [a for a in usable if a.account.lower() == request.account.lower()]
        if not usable:
            return (
                f"{request.name} asks for account {request.account!r} on partition {partition!r}; your "
                f"associations (sacctmgr) there are {', '.join(accounts) or 'none'} (resources.slurm.account)"
            )
    if request.qos is not None and not any(request.qos in a.qos for a in usable):
        allowed = sorted({q for a in usable for q in a.qos})
        return (
            f"{request.name} asks for QoS {request.qos!r} on partition {partition!r}"
            + (f" under account {request.account!r}" if request.account else "")
            + f"; your associations allow {', '.join(allowed) or 'none'} (resources.slurm.gpu.qos, .cpu.qos)"
        )
    return None


def fits(request: Request, node: Node) -> bool:
    return (
        request.cpus <= node.cpus
        and request.mem_mb <= node.mem_mb
        and request.gpus <= node.gpus
        and (node.max_minutes is None or request.runtime <= node.max_minutes)
    )


def problems(requests: list[Request], nodes: list[Node], associations: list[Association] | None = None) -> list[str]:
    """One line per distinct request that no node of its partition can run, or whose account or QoS the
    user's `associations` (None: not known) do not allow there."""
    lines = []
    for request in sorted(set(requests), key=lambda r: (r.name, r.partition or "")):
        partition = request.partition or next((n.partition for n in nodes if n.default), None)
        candidates = [n for n in nodes if n.partition == partition]
        asks = f"cpus_per_task={request.cpus}, mem_mb={request.mem_mb}, runtime={request.runtime}, gpu={request.gpus}"
        refused = association_problem(request, partition, associations) if associations else None
        if refused:
            lines.append(refused)
        if not candidates:
            lines.append(
                f"{request.name}: partition {partition!r} does not exist ({asks}); sinfo lists "
                f"{', '.join(sorted({n.partition for n in nodes}))} (resources.slurm.gpu.partition, .cpu.partition)"
            )
        elif not any(fits(request, n) for n in candidates):
            largest = max(candidates, key=lambda n: (n.cpus, n.mem_mb, n.gpus))
            limit = largest.max_minutes if largest.max_minutes is not None else "unlimited"
            lines.append(
                f"{request.name} asks partition {partition!r} for {asks}; its largest node "
                f"has {largest.cpus} CPUs, {largest.mem_mb} MB, {largest.gpus} GPUs, time limit "
                f"{limit}"
            )
    return lines


def check(requests: list[Request], nodes: list[Node], associations: list[Association] | None = None) -> None:
    found = problems(requests, nodes, associations)
    if found:
        raise UnsatisfiableRequest(
            "SLURM could never start these jobs (sbatch would refuse them, or leave them pending forever):\n  "
            + "\n  ".join(found)
            + "\nSet resources.slurm (partitions, QoS, account) and resources.jobs.<rule> (heavy rules) in the "
            "config, or the profile's default-resources and --max-threads (other rules), to what the cluster "
            "has; a group job asks for the sum of its jobs' runtimes (more nodes, fewer jobs per group job: "
            "resources.nodes)."
        )
