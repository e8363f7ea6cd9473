"""The SLURM profile run for real: `snakemake --profile profiles/slurm` on the single-node test
cluster (tests/slurm). tests/real_sglang/test_workflow.py runs the real-SGLang 2 x 3 run there: its GPU
stages as group jobs, the server and the capture runner in job steps of their own, outputs equal to
the local run's.
"""

import yaml

from .conftest import REPO, copy_workflow, snakemake
from .slurm import NODE_SIZED, SLURM_ARGS, sacct_jobs


def demo_config(**overrides) -> dict:
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    return {**config, **overrides}


def test_a_request_no_node_can_meet_fails_before_any_submission(slurm_cluster, tmp_path):
    work = copy_workflow(tmp_path / "wf")
    # The demo config as shipped: hidden_states keeps the production 512,000 MB and 32 CPUs.
    (work / "slurm.yaml").write_text(yaml.safe_dump(demo_config()))
    before = len(sacct_jobs())
    proc = snakemake([*SLURM_ARGS, "--configfile", "slurm.yaml"], work, check=False)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "SLURM could never start these jobs" in out
    # the 5 shard jobs and their 5 baseline twins' (evaluate.baseline: original) are one group job (the
    # profile), one after another on one node: its runtime adds up
    assert "group capture (10 jobs) asks partition 'cpu' for cpus_per_task=32, mem_mb=512000, runtime=14400" in out
    assert "resources.jobs.<rule>" in out
    assert len(sacct_jobs()) == before  # nothing was submitted


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
