"""The SLURM profile run for real: `snakemake --profile profiles/slurm` on a single-node cluster.

tests/slurm/cluster.sh starts Debian's slurm-wlm (slurmctld, slurmd), slurmdbd on a private
MariaDB (the executor plugin reads job status with `sacct`) and munge, with a `cpu` and a `gpu`
partition; the fixture stops every daemon by its pidfile, also when a test fails. The `gpu`
partition's 8 GPUs are character devices without a GPU behind them: SLURM schedules, allocates and
accounts them for real, the jobs compute on CPU (this machine has no GPU).
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from snakemake.utils import validate

from eagle3_datagen.workflow import cluster_fit

from .conftest import REPO, copy_workflow, run, snakemake

CLUSTER = REPO / "tests/slurm/cluster.sh"
needs_cluster = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("slurmctld") is None or shutil.which("slurmdbd") is None,
    reason="needs root and Debian's slurm-wlm, slurmdbd, munge and mariadb-server (`make test` installs them as root)",
)
# The node has the CI machine's cores and memory; these requests fit it (a site sets its own).
NODE_SIZED = {"resources": {"jobs": {"hidden_states": {"mem_mb": 3000, "cpus_per_task": 2, "runtime": 30}}}}
SLURM_ARGS = [
    "--profile", "profiles/slurm",
    "--default-resources", "mem_mb=3000", "runtime=30", "nodes=1", "slurm_partition=cpu",
    # The local demo runs with 2 cores, so no rule gets more threads there either.
    "--max-threads", "2",
    # The production profile's poll interval is Snakemake's default; a test waits less.
    "--seconds-between-status-checks", "3", "--slurm-init-seconds-before-status-checks", "3",
]  # fmt: skip


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    state = tmp_path_factory.mktemp("slurm")
    try:
        run([str(CLUSTER), "start", str(state)], REPO)
        yield state
    finally:
        run([str(CLUSTER), "stop", str(state)], REPO, check=False)


def demo_config(**overrides) -> dict:
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    return {**config, **overrides}


def without_timings(value):
    """A JSON value without wall-clock fields (`seconds`, `..._per_s`): no two runs agree on them."""
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items() if k != "seconds" and not k.endswith("_per_s")}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value


def sacct_jobs() -> list[dict]:
    out = subprocess.run(
        ["sacct", "-a", "-X", "-n", "-P", "-o", "JobID,Comment,Partition,AllocTRES,State"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    keys = ["id", "comment", "partition", "tres", "state"]
    return [dict(zip(keys, line.split("|"), strict=True)) for line in out.splitlines() if line]


@needs_cluster
def test_a_request_no_node_can_meet_fails_before_any_submission(slurm_cluster, tmp_path):
    work = copy_workflow(tmp_path / "wf")
    # The demo config as shipped: hidden_states keeps the production 512,000 MB and 32 CPUs.
    (work / "slurm.yaml").write_text(yaml.safe_dump(demo_config()))
    before = len(sacct_jobs())
    proc = snakemake([*SLURM_ARGS, "--configfile", "slurm.yaml"], work, check=False)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "SLURM could never start these jobs" in out
    assert "rule hidden_states asks partition 'cpu' for cpus_per_task=32, mem_mb=512000" in out
    assert "resources.jobs.<rule>" in out
    assert len(sacct_jobs()) == before  # nothing was submitted


@needs_cluster
def test_prompt_jobs_under_slurm_match_the_local_run(slurm_cluster, tmp_path):
    """Every prompts job through sbatch and sacct, one of them on the gpu partition with gpu=8."""
    targets = [
        f"results/{p}/prompts/{name}"
        for p, shards in [("demo_alpaca", 1), ("demo_openai", 2), ("demo_sharegpt", 2)]
        for name in ["stats.json", *[f"{s:05d}.jsonl.zst" for s in range(shards)]]
    ]
    local = copy_workflow(tmp_path / "local")
    snakemake([*targets, "--profile", "profiles/local"], local)
    work = copy_workflow(tmp_path / "slurm")
    (work / "slurm.yaml").write_text(yaml.safe_dump(demo_config(**NODE_SIZED)))
    before = {job["id"] for job in sacct_jobs()}
    snakemake(
        [*targets, *SLURM_ARGS, "--configfile", "slurm.yaml",
         "--set-resources", "prompts_demo_sharegpt:slurm_partition=gpu", "prompts_demo_sharegpt:gpu=8"],
        work,
    )  # fmt: skip
    jobs = {job["comment"]: job for job in sacct_jobs() if job["id"] not in before}
    assert sorted(jobs) == ["rule_prompts_demo_alpaca", "rule_prompts_demo_openai", "rule_prompts_demo_sharegpt"]
    assert all(job["state"] == "COMPLETED" for job in jobs.values()), jobs
    assert jobs["rule_prompts_demo_sharegpt"]["partition"] == "gpu"
    assert "gres/gpu=8" in jobs["rule_prompts_demo_sharegpt"]["tres"]
    assert jobs["rule_prompts_demo_alpaca"]["partition"] == "cpu"
    assert "gres/gpu" not in jobs["rule_prompts_demo_alpaca"]["tres"]
    for target in targets:
        assert (work / target).read_bytes() == (local / target).read_bytes(), target


# One partition's whole chain, every kind of per-partition job: the demo model, prompts, responses,
# tokens, hidden states (on the gpu partition), probe, both exports and the partition's summary. The
# rules that combine partitions (vocab, summary.html) are CPU jobs like these and run in the local demo.
ONE_PARTITION = [
    "results/demo_alpaca/export/specforge",
    "results/demo_alpaca/export/speculators",
    "results/report/demo_alpaca.json",
]


@needs_cluster
def test_a_partition_under_slurm_matches_the_local_demo(slurm_cluster, demo_dir, tmp_path):
    work = copy_workflow(tmp_path / "wf")
    (work / "slurm.yaml").write_text(yaml.safe_dump(demo_config(**NODE_SIZED)))
    before = {job["id"] for job in sacct_jobs()}
    # hidden_states is the rule that asks for a whole 8-GPU node in production: send it there.
    snakemake(
        [*ONE_PARTITION, *SLURM_ARGS, "--configfile", "slurm.yaml",
         "--set-resources", "hidden_states:slurm_partition=gpu", "hidden_states:gpu=8"],
        work,
    )  # fmt: skip
    jobs = [job for job in sacct_jobs() if job["id"] not in before]
    ran = sorted(job["comment"].split("_wildcards")[0] for job in jobs)
    assert all(job["state"] == "COMPLETED" for job in jobs), jobs
    assert ran == sorted(
        ["rule_build_demo_model", "rule_prompts_demo_alpaca", "rule_responses", "rule_tokens", "rule_hidden_states",
         "rule_probe", "rule_export", "rule_export", "rule_partition_summary"]
    )  # fmt: skip
    hidden = [job for job in jobs if job["comment"].startswith("rule_hidden_states")]
    assert all(job["partition"] == "gpu" and "gres/gpu=8" in job["tres"] for job in hidden), hidden
    others = [job for job in jobs if job not in hidden]
    assert all(job["partition"] == "cpu" and "gres/gpu" not in job["tres"] for job in others), others

    slurm = {p.relative_to(work): p for p in (work / "results").rglob("*") if p.is_file()}
    local = {name: demo_dir / name for name in slurm}
    assert all(path.exists() for path in local.values()), sorted(n for n, p in local.items() if not p.exists())
    differ = sorted(name for name in local if local[name].read_bytes() != slurm[name].read_bytes())
    # Only files that record a job's wall-clock time may differ, and only in those fields, and the
    # exports' READMEs, configs and commands, which name their own absolute paths.
    here, there = str(work.resolve()), str(demo_dir.resolve())
    named_paths = {name for name in differ if name.suffix != ".json"}
    for name in sorted(named_paths):
        assert "/export/" in str(name), name
        assert local[name].read_text() == slurm[name].read_text().replace(here, there), name

    def comparable(name: Path, text: str) -> dict:
        """The JSON without wall-clock fields, and without the checksums of the files that name paths."""
        value = without_timings(json.loads(text.replace(here, there)))
        if "files" in value:
            value["files"] = {f: c for f, c in value["files"].items() if name.parent / f not in named_paths}
        return value

    for name in differ:
        if name.suffix == ".json":
            assert comparable(name, local[name].read_text()) == comparable(name, slurm[name].read_text()), name
    assert Path("results/demo_alpaca/hidden/00000/part-00000.safetensors") in slurm
    assert Path("results/demo_alpaca/hidden/00000/part-00000.safetensors") not in differ
    assert Path("results/demo/model/model.safetensors") in slurm


def test_sinfo_nodes_are_parsed():
    nodes = cluster_fit.parse_sinfo("cpu*|64|512000|(null)|2-00:00:00\ngpu|96|2000000+|gpu:h200:8(S:0-1)|infinite\n")
    assert nodes == [
        cluster_fit.Node("cpu", 64, 512000, 0, 2880, default=True),
        cluster_fit.Node("gpu", 96, 2000000, 8, None),
    ]
    assert [cluster_fit.minutes(t) for t in ("30", "45:00", "4:30:00", "1-12", "1-00:30")] == [30, 45, 270, 2160, 1470]


def test_requests_no_node_can_meet_are_named_with_the_fix():
    nodes = cluster_fit.parse_sinfo("cpu*|2|22000|(null)|1:00:00\ngpu|2|22000|gpu:8|infinite\n")
    fits = cluster_fit.Request("rule tokens", None, 2, 3000, 30, 0)
    assert cluster_fit.problems([fits, fits], nodes) == []
    too_many_cpus = cluster_fit.Request("rule hidden_states", "cpu", 32, 3000, 30, 0)
    too_long = cluster_fit.Request("rule probe", "cpu", 1, 3000, 61, 0)
    gpus_on_cpu = cluster_fit.Request("rule responses", "cpu", 1, 3000, 30, 8)
    gpus_on_gpu = cluster_fit.Request("rule responses", "gpu", 1, 3000, 30, 8)
    no_such = cluster_fit.Request("rule export", "bigmem", 1, 1, 1, 0)
    found = cluster_fit.problems([too_many_cpus, too_long, gpus_on_cpu, gpus_on_gpu, no_such], nodes)
    assert found == [
        "rule export: partition 'bigmem' does not exist (cpus_per_task=1, mem_mb=1, runtime=1, gpu=0)",
        "rule hidden_states asks partition 'cpu' for cpus_per_task=32, mem_mb=3000, runtime=30, gpu=0; "
        "its largest node has 2 CPUs, 22000 MB, 0 GPUs, time limit 60",
        "rule probe asks partition 'cpu' for cpus_per_task=1, mem_mb=3000, runtime=61, gpu=0; "
        "its largest node has 2 CPUs, 22000 MB, 0 GPUs, time limit 60",
        "rule responses asks partition 'cpu' for cpus_per_task=1, mem_mb=3000, runtime=30, gpu=8; "
        "its largest node has 2 CPUs, 22000 MB, 0 GPUs, time limit 60",
    ]
    with pytest.raises(cluster_fit.UnsatisfiableRequest, match="resources.jobs.<rule>"):
        cluster_fit.check([too_many_cpus], nodes)


def test_production_job_sizes_are_the_schema_defaults():
    """A config without resources.jobs asks for what the profile used to set for every site."""
    config = demo_config()
    validate(config, str(REPO / "schemas/config.schema.yaml"))
    assert config["resources"]["jobs"] == {
        "hidden_states": {"mem_mb": 512000, "cpus_per_task": 32, "runtime": 1440},
        "responses_sglang_server": {"mem_mb": 512000, "cpus_per_task": 32, "runtime": 2880},
    }
