"""Where the jobs run: the GPUs a stage's job takes, and what its cluster job asks SLURM for."""

from __future__ import annotations

import math

from eagle3_datagen.backends.plugins import CAPTURE, GENERATION, SERVED_RESPONSE_RULE
from eagle3_datagen.workflow.partitions import inference_backend, launched_backends


def uses_gpu(config: dict, stage: str, partition: str | None = None) -> bool:
    if stage == "responses":
        return GENERATION[inference_backend(config, partition)].uses_gpu(config)
    return CAPTURE[config["hidden_states"]["backend"]].uses_gpu(config)


def gpus_for(config: dict, stage: str, partition: str | None = None) -> int:
    """GPUs a job of `stage` asks for; only the responses stage depends on the partition."""
    return config["resources"]["gpus_per_node"] if uses_gpu(config, stage, partition) else 0


def launcher(config: dict, rule: str) -> str | None:
    """What a GPU stage's job starts on its node (the capture's torchrun, the launched server its node
    service runs) and so launches itself, a process per GPU: the slurm plugin's name for its launcher.
    None: the config launches no server, and the served rule has no job. A name only: the plugin runs any
    such job in its allocation's batch step."""
    if rule == SERVED_RESPONSE_RULE:
        return next((GENERATION[name].launcher for name in launched_backends(config)), None)
    return "torchrun"


def served_response_gpus(config: dict, shared: bool) -> int:
    """GPUs a shard job of a launched server's partitions asks for. Where Snakemake runs on the node and deals
    out its GPUs (`shared`), the launched backend's `launch.shard_jobs` of them use the node's server at once
    (the next shard's requests start while the last one's longest answers drain), so each asks for that share
    of the node's GPUs, rounded up: together they fit the node's pool, and a capture job (all of them) still
    waits until none runs. Else (a cluster job: its allocation), or with no launched server, the whole node."""
    gpus = config["resources"]["gpus_per_node"]
    jobs = [GENERATION[name].settings(config)["launch"]["shard_jobs"] for name in launched_backends(config)]
    return -(-gpus // min(jobs)) if shared and jobs else gpus


def slurm_resources(config: dict, gpus: int) -> dict:
    """Where a job goes under SLURM (`resources.slurm`): a job that asks for GPUs to the GPU partition and its
    QoS, any other to the CPU one's, both under the account; as the slurm executor plugin's resources
    (`slurm_partition`, `qos`, `slurm_account`), those not set left out. Local runs ignore them."""
    slurm = config["resources"]["slurm"]
    where = slurm["gpu" if gpus else "cpu"]
    asked = {"slurm_partition": where["partition"], "qos": where["qos"], "slurm_account": slurm["account"]}
    return {key: value for key, value in asked.items() if value is not None}


def cluster_job(config: dict, rule: str, gpus: int) -> dict:
    """What a heavy rule's cluster job asks for: `resources.jobs.<rule>` (memory, CPUs and minutes of the
    job) where `slurm_resources` sends it. A job on more than one GPU of its node is one that launches its
    own processes, one task per GPU (the plugin's `mpi` jobs): the slurm-jobstep executor runs such a job in
    its allocation's batch step instead of a job step of its own, so the node service it starts outlives it
    and serves the allocation's next shard jobs (SLURM kills what a job step leaves behind when the step
    ends). Its CPUs are asked for per task. Local runs ignore all of these."""
    job = dict(config["resources"]["jobs"][rule]) | slurm_resources(config, gpus)
    if gpus > 1 and (started := launcher(config, rule)):
        job.update(mpi=started, tasks_per_node=gpus, cpus_per_task=max(1, job["cpus_per_task"] // gpus))
    return job


def spread_over_nodes(workflow, group: str, rule: str, nodes: int) -> None:
    """Set how many jobs of `group` go to one group job (Snakemake's --group-components) so that the scheduled
    jobs of `rule` spread over `nodes` nodes: ceil(jobs / nodes) each. Called while Snakemake forms its group
    jobs (by the rule's `group` function, once the jobs it will run are known: a rerun after a crash spreads
    what is left), once per run, never over a count given on the command line. `workflow`: Snakemake's."""
    settings = workflow.group_settings
    if group not in settings.group_components:
        jobs = sum(job.rule.name == rule for job in workflow.dag.needrun_jobs())
        settings.group_components = {**settings.group_components, group: max(1, math.ceil(jobs / nodes))}
