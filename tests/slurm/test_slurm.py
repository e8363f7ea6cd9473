"""The SLURM profile run for real: `snakemake --profile profiles/slurm` on the single-node test
cluster (tests/slurm), and docs/slurm.md's four-node walk-through dry-run there. tests/real_sglang/
test_workflow.py runs the real-SGLang 2 x 3 run there: its GPU stages as group jobs, the server and the
capture runner in job steps of their own, outputs equal to the local run's.
"""

import re
import textwrap

import yaml

from eagle3_datagen.reporting.plan import scheduled_jobs
from eagle3_datagen.workflow import cluster_fit
from tests.helpers import REPO, copy_workflow, kimi_sources, snakemake
from tests.slurm import NODE_SIZED, SLURM_ARGS, sacct_jobs


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


def walkthrough_resources() -> dict:
    """The `resources` a user writes from docs/slurm.md's four-node walk-through (its step 3 block)."""
    text = (REPO / "docs/slurm.md").read_text()
    section = text[text.index("## Four GPU nodes, step by step") : text.index("## How it runs")]
    return yaml.safe_load(textwrap.dedent(re.search(r"```yaml\n(.*?)```", section, re.S)[1]))["resources"]


def test_the_walkthroughs_four_nodes_dry_run_with_their_partitions_account_and_qos(slurm_cluster, tmp_path):
    """The Kimi config with the walk-through's resources: each GPU stage's 32 shards over four nodes (one
    group job of 8 each), every job on the walk-through's partitions, account and QoS; each group job fits a
    node of the test cluster's `h200` (this node and three declared: sinfo lists four) within its 2-day
    limit, under an account and a QoS that sacctmgr gives the user there."""
    work = copy_workflow(tmp_path / "wf")
    kimi_sources(work)
    config = yaml.safe_load((REPO / "config/kimi-k2.5-sglang.yaml").read_text())
    (work / "four.yaml").write_text(yaml.safe_dump({**config, "resources": walkthrough_resources()}))
    out = snakemake(["-n", "--profile", "profiles/slurm", "--configfile", "four.yaml"], work).stdout
    jobs = scheduled_jobs(out)
    for rule in ("responses_served", "hidden_states"):
        groups = [j.group for j in jobs if j.rule == rule]
        assert len(groups) == 32 and sorted(groups.count(g) for g in set(groups)) == [8, 8, 8, 8], rule
    blocks = [b for b in re.split(r"\n\s*\[[^\]]*\]\n", out) if re.search(r"^\s*rule \S+:", b, re.M)]
    requests = []
    for block in blocks:
        rule = re.search(r"^\s*rule (\S+):", block, re.M)[1]
        resources = dict(kv.split("=", 1) for kv in re.search(r"resources: (.*)", block)[1].split(", "))
        if rule in ("responses_served", "hidden_states"):
            where = (resources["slurm_partition"], resources["qos"], resources["slurm_account"])
            assert where == ("h200", "gpu-week", "llm-team"), block
            # a group job: its 8 jobs one after another on one node
            cpus = int(resources["cpus_per_task"]) * int(resources["tasks_per_node"])
            requests.append(cluster_fit.Request(f"group of {rule}", "h200", cpus, int(resources["mem_mb"]),
                                                8 * int(resources["runtime"]), 8, "llm-team", "gpu-week"))  # fmt: skip
        elif rule != "all":
            assert resources["slurm_partition"] == "cpu" and resources["slurm_account"] == "llm-team", block
            assert "qos" not in resources
    assert out.count("Group job capture") == out.count("Group job generation") == 4
    nodes = cluster_fit.read_nodes()
    assert sorted(n.cpus for n in nodes if n.partition == "h200")[1:] == [96, 96, 96]  # four nodes in all
    assert requests and cluster_fit.problems(requests, nodes, cluster_fit.read_associations()) == []


def test_prompt_jobs_under_slurm_match_the_local_run(slurm_cluster, tmp_path):
    """Every prompts job through sbatch and sacct under the walk-through's account (enforced by the test
    cluster), one of them on its GPU partition with its QoS and gpu=8."""
    targets = [
        f"results/{p}/prompts/{name}"
        for p, shards in [("demo_alpaca", 1), ("demo_openai", 2), ("demo_sharegpt", 2)]
        for name in ["stats.json", *[f"{s:05d}.jsonl.zst" for s in range(shards)]]
    ]
    local = copy_workflow(tmp_path / "local")
    snakemake([*targets, "--profile", "profiles/local"], local)
    work = copy_workflow(tmp_path / "slurm")
    resources = {**NODE_SIZED["resources"], "slurm": walkthrough_resources()["slurm"]}
    (work / "slurm.yaml").write_text(yaml.safe_dump(demo_config(resources=resources)))
    before = {job["id"] for job in sacct_jobs()}
    snakemake(
        [*targets, *SLURM_ARGS, "--configfile", "slurm.yaml", "--set-resources",
         "prompts_demo_sharegpt:slurm_partition=h200", "prompts_demo_sharegpt:qos=gpu-week",
         "prompts_demo_sharegpt:gpu=8"],
        work,
    )  # fmt: skip
    jobs = {job["comment"]: job for job in sacct_jobs() if job["id"] not in before}
    assert sorted(jobs) == ["rule_prompts_demo_alpaca", "rule_prompts_demo_openai", "rule_prompts_demo_sharegpt"]
    assert all(job["state"] == "COMPLETED" for job in jobs.values()), jobs
    assert {job["account"] for job in jobs.values()} == {"llm-team"}
    sharegpt, alpaca = jobs["rule_prompts_demo_sharegpt"], jobs["rule_prompts_demo_alpaca"]
    assert (sharegpt["partition"], sharegpt["qos"]) == ("h200", "gpu-week")
    assert "gres/gpu=8" in sharegpt["tres"]
    assert (alpaca["partition"], alpaca["qos"]) == ("cpu", "normal") and "gres/gpu" not in alpaca["tres"]
    for target in targets:
        assert (work / target).read_bytes() == (local / target).read_bytes(), target
