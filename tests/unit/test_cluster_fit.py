"""What the SLURM profile checks before it submits anything (workflow/cluster_fit.py): sinfo's nodes
parsed, requests no node can meet named with the fix, and the production job sizes the schema sets.
No cluster runs here; tests/slurm/test_slurm.py runs the profile on the SLURM test cluster.
"""

import pytest
import yaml
from snakemake.utils import validate

from eagle3_datagen import config_schema
from eagle3_datagen.workflow import cluster_fit
from tests.helpers import REPO


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
        "rule export: partition 'bigmem' does not exist (cpus_per_task=1, mem_mb=1, runtime=1, gpu=0); sinfo lists "
        "cpu, gpu (resources.slurm.gpu.partition, .cpu.partition)",
        "rule hidden_states asks partition 'cpu' for cpus_per_task=32, mem_mb=3000, runtime=30, gpu=0; "
        "its largest node has 2 CPUs, 22000 MB, 0 GPUs, time limit 60",
        "rule probe asks partition 'cpu' for cpus_per_task=1, mem_mb=3000, runtime=61, gpu=0; "
        "its largest node has 2 CPUs, 22000 MB, 0 GPUs, time limit 60",
        "rule responses asks partition 'cpu' for cpus_per_task=1, mem_mb=3000, runtime=30, gpu=8; "
        "its largest node has 2 CPUs, 22000 MB, 0 GPUs, time limit 60",
    ]
    with pytest.raises(cluster_fit.UnsatisfiableRequest, match="resources.jobs.<rule>"):
        cluster_fit.check([too_many_cpus], nodes)


def test_an_account_or_qos_the_user_may_not_use_there_is_named():
    """As `sacctmgr -n -P show assoc user=USER format=account,partition,qos` lists them (the SLURM test
    cluster's, tests/slurm/cluster.sh: llm-team may use gpu-week anywhere; a partition-bound one too)."""
    associations = cluster_fit.parse_associations("root||gpu-week,normal\nllm-team||gpu-week,normal\nbio|cpu|normal\n")
    assert associations[0] == cluster_fit.Association("root", None, frozenset({"gpu-week", "normal"}))
    nodes = cluster_fit.parse_sinfo("cpu*|2|22000|(null)|infinite\nh200|96|2000000|gpu:8|2-00:00:00\n")
    ok = cluster_fit.Request("group capture (8 jobs)", "h200", 64, 1000, 2400, 8, "llm-team", "gpu-week")
    assert cluster_fit.problems([ok], nodes, associations) == []
    any_case = cluster_fit.Request("rule tokens", None, 1, 1, 1, 0, "LLM-team")
    assert cluster_fit.problems([any_case], nodes, associations) == []
    wrong_account = cluster_fit.Request("rule tokens", "cpu", 1, 1, 1, 0, "llm-taem")
    wrong_qos = cluster_fit.Request("group capture (8 jobs)", "h200", 64, 1000, 2400, 8, "llm-team", "gpu-weak")
    bound = cluster_fit.Request("rule export", "h200", 1, 1, 1, 0, "bio")
    assert cluster_fit.problems([wrong_account, wrong_qos, bound], nodes, associations) == [
        "group capture (8 jobs) asks for QoS 'gpu-weak' on partition 'h200' under account 'llm-team'; your "
        "associations allow gpu-week, normal (resources.slurm.gpu.qos, .cpu.qos)",
        "rule export asks for account 'bio' on partition 'h200'; your associations (sacctmgr) there are llm-team, root "
        "(resources.slurm.account)",
        "rule tokens asks for account 'llm-taem' on partition 'cpu'; your associations (sacctmgr) there are bio, "
        "llm-team, root (resources.slurm.account)",
    ]
    # without accounting (no sacctmgr, or no association) nothing of this is checked
    assert cluster_fit.problems([wrong_account], nodes, None) == []


def test_production_job_sizes_are_the_schema_defaults():
    """A config without resources.jobs asks for what the profile used to set for every site."""
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    validate(config, str(config_schema.SCHEMA_PATH))
    assert config["resources"]["jobs"] == {
        "hidden_states": {"mem_mb": 512000, "cpus_per_task": 32, "runtime": 1440},
        "responses_served": {"mem_mb": 512000, "cpus_per_task": 32, "runtime": 2880},
        "responses": {"runtime": 240, "api_runtime": None, "api_answer_tokens_per_s": 20},
    }
