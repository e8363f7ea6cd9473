"""Starting a service's supervisor: a process of its own session, or inside a SLURM allocation a job
step of its own.

Inside a SLURM allocation the supervisor is started as a job step (`srun --overlap`, on this node,
with the service's GPUs), which ends at the latest with the allocation. SLURM kills what a job step
leaves behind when the step ends (proctrack/cgroup) and cancels a step whose srun client is gone, so
the service outlives the job that started it only where that job runs in the allocation's batch
step: the GPU stages' jobs do, as jobs that launch their own processes, one per GPU
(`workflow.placement.cluster_job`). A job in a step of its own gets a service that ends with it. Each
allocation has its own node directory.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import uuid
from dataclasses import asdict, replace
from pathlib import Path

from eagle3_datagen.backends.service import Service, supervise
from eagle3_datagen.backends.service.record import FAILED, LOADED, RECORD, where
from eagle3_datagen.formats import service_loads
from eagle3_datagen.formats.files import write_json

log = logging.getLogger(__name__)

# The job step's own settings that a nested srun would take as its defaults (the slurm-jobstep executor
# plugin clears them the same way for its srun); the allocation's identity stays.
SLURM_KEEP = {"SLURM_JOB_ID", "SLURM_JOBID", "SLURM_CLUSTER_NAME", "SLURM_CONF"}
SLURM_STEP_PREFIXES = ("SLURM_", "SRUN_", "SBATCH_")


def log_path(base: str | Path) -> Path:
    """`base`, or under SLURM `base` with the allocation in its name: nodes do not write one file."""
    job = os.environ.get("SLURM_JOB_ID")
    base = Path(base)
    return base.with_name(f"{base.stem}.slurm-{job}{base.suffix}") if job else base


def start(directory: Path, service: Service) -> dict:
    """Start a supervisor for `service` and write its record; the caller holds the node lock."""
    for left in (LOADED, FAILED):  # of the service before
        (directory / left).unlink(missing_ok=True)
    token = uuid.uuid4().hex
    output = log_path(service.log).resolve()
    output.parent.mkdir(parents=True, exist_ok=True)
    loads = log_path(output.with_name(service_loads.NAME).resolve())
    service = replace(service, log=str(output))
    log_from = output.stat().st_size if output.exists() else 0
    command = [sys.executable, "-m", supervise.__name__, "--token", token, "--loads", str(loads)]
    command += ["--service", json.dumps(asdict(service))]
    launcher, env = slurm_step(service), None
    if launcher:
        env = {k: v for k, v in os.environ.items() if k in SLURM_KEEP or not k.startswith(SLURM_STEP_PREFIXES)}
    with open(output, "ab") as out:
        process = subprocess.Popen(
            [*launcher, *command], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, env=env,
        )  # fmt: skip
    # The starter's pid until the supervisor writes its own (under SLURM, the starter is the srun client).
    record = {"pid": process.pid, "token": token, "key": service.key, "name": service.name}
    record |= {"log": str(output), "log_from": log_from, "where": where()}
    write_json(directory / RECORD, record)
    log.info("starting the node's %s (its output: %s)", service.name, output)
    return record


def slurm_step(service: Service) -> list[str]:
    """Inside a SLURM allocation, an srun command that starts the supervisor as a job step of its own on
    this node, sharing the allocation's CPUs, memory and GPUs with the shard jobs."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job or shutil.which("srun") is None:
        return []
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    step = ["srun", "--overlap", f"--jobid={job}", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--mem=0"]
    if cpus := os.environ.get("SLURM_CPUS_ON_NODE"):
        step.append(f"--cpus-per-task={cpus}")
    if service.gpus:
        step.append(f"--gpus={service.gpus}")
    # The step writes its output to the service's log itself, on the node: nothing goes through the srun
    # client.
    output = ["--input=none", f"--output={service.log}", f"--error={service.log}", "--open-mode=append"]
    return [*step, *output, f"--job-name={service.name.replace(' ', '-')}"]
