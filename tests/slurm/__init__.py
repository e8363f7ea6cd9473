"""The single-node SLURM test cluster (cluster.sh) and what the tests that run on it share.

cluster.sh starts Debian's slurm-wlm (slurmctld, slurmd), slurmdbd on a private MariaDB (the executor
plugin reads job status with `sacct`) and munge, with a `cpu` and a `gpu` partition, and docs/slurm.md's
walk-through: its partition `h200` (this node and three that never start), account and QoS; the fixture
stops every daemon by its pidfile, also when a test fails. The `gpu` partition's 8 GPUs are character
devices without a GPU behind them: SLURM schedules, allocates and accounts them for real, the jobs
compute on CPU (this machine has no GPU).
"""

import fcntl
import os
import shutil
import subprocess

import pytest

from tests.helpers import REPO, run

CLUSTER = REPO / "tests/slurm/cluster.sh"
SLURM_ARGS = [
    "--profile", "profiles/slurm",
    "--default-resources", "mem_mb=3000", "runtime=30", "nodes=1",
    # The local demo runs with 2 cores, so no rule gets more threads there either.
    "--max-threads", "2",
    # The production profile's poll interval is Snakemake's default; a test waits less.
    "--seconds-between-status-checks", "3", "--slurm-init-seconds-before-status-checks", "3",
]  # fmt: skip
# The node has the CI machine's cores and memory; these requests fit it (a site sets its own).
JOB_SIZE = {"mem_mb": 3000, "cpus_per_task": 2, "runtime": 30}
NODE_SIZED = {"resources": {"jobs": {"hidden_states": JOB_SIZE, "responses_served": JOB_SIZE}}}
DAEMONS = ("slurmctld", "slurmd", "slurmdbd", "munged", "mariadbd")
# One cluster on the machine at a time (its daemons, ports and /etc/slurm): `make test` runs the SGLang
# tier beside the main one, and each starts the cluster for its own SLURM module.
MACHINE_LOCK = "/tmp/eagle3-datagen-slurm-test-cluster.lock"


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    missing = [d for d in DAEMONS if not shutil.which(d, path=f"{os.environ['PATH']}:/usr/sbin")]
    if os.geteuid() != 0 or missing:
        pytest.fail(f"the SLURM test cluster needs root and {missing or DAEMONS}: `make test` installs them as root")
    state = tmp_path_factory.mktemp("slurm")
    with open(MACHINE_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            run([str(CLUSTER), "start", str(state)], REPO)
            yield state
        finally:
            run([str(CLUSTER), "stop", str(state)], REPO, check=False)


def sacct_jobs(*job_ids: str, steps: bool = False) -> list[dict]:
    """Jobs (with `steps`, their steps too) that accounting knows: id, comment, name, partition, tres, node, state,
    account, qos."""
    keys = ["id", "comment", "name", "partition", "tres", "node", "state", "account", "qos"]
    fields = "JobID,Comment,JobName,Partition,AllocTRES,NodeList,State,Account,QOS"
    # sacct's window starts at today's midnight unless jobs are named: a run across midnight would lose its
    # first jobs (with -j it starts at the epoch)
    which = ["-j", ",".join(job_ids)] if job_ids else ["-S", "2000-01-01"]
    out = subprocess.run(
        ["sacct", "-a", *([] if steps else ["-X"]), "-n", "-P", "-o", fields, *which],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    return [dict(zip(keys, line.split("|"), strict=True)) for line in out.splitlines() if line]


def without_timings(value):
    """A JSON value without wall-clock fields (`seconds`, `..._per_s`) and a shard's `throughput` (the tokens
    this run captured: none where a stopped run had written every part): no two runs agree on them."""
    if isinstance(value, dict):
        return {
            k: without_timings(v)
            for k, v in value.items()
            if k not in ("seconds", "throughput") and not k.endswith("_per_s")
        }
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value
