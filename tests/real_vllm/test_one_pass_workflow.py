"""The workflow end to end in one-pass mode (`hidden_states.one_pass: true`) on real vLLM: the launched server
saves every request's states, the responses jobs stage each conversation's last turn's, and the
hidden_states jobs only pack them: no capture runner starts, no model loads for capture. The run of
tests/real_vllm/test_workflow.py with that one setting changed; one run serves the module."""

import json
import shutil

import pytest
import yaml

from eagle3_datagen.formats.hidden_shard import HiddenShard
from tests.helpers import copy_workflow
from tests.real_vllm.test_workflow import PARTITIONS, against_prefill, rows, run_config, shards, snakemake_run


@pytest.fixture(scope="module")
def one_pass_run(tmp_path_factory, demo_results):
    work = copy_workflow(tmp_path_factory.mktemp("vllm-one-pass") / "wf")
    shutil.copytree(demo_results, work / "results" / "demo")  # conftest.py builds it once for the tier
    config = run_config()
    config["hidden_states"]["one_pass"] = True
    (work / "one_pass.yaml").write_text(yaml.safe_dump(config))
    snakemake_run(work, "one_pass.yaml")
    return work


def test_the_shards_are_the_servers_states_packed_with_no_capture_model(one_pass_run):
    """Each stored sample is its token row but the last generated id (what the server never ran), with the
    states of those ids as a separate transformers prefill computes them, stored bf16 (where vLLM's float32
    sums fall on the other side of a bf16 rounding boundary, one step off); no capture runner
    ran, and neither the server's files nor the staged folders are left."""
    work = one_pass_run
    assert not (work / "logs/capture_runner").exists()
    server_log = (work / "logs/server/server.log").read_text()
    # every start (another run's end on the machine may stop an idle one: test_workflow.py counts them)
    starts = [line for line in server_log.splitlines() if "starting the vLLM server" in line]
    assert starts and all("--speculative-config" in line and "--no-enable-prefix-caching" in line for line in starts)
    worst, rounded_apart, values = 0.0, 0, 0
    for partition in PARTITIONS:
        stored = [sample for shard in shards(work, partition) for sample in HiddenShard(shard)]
        tokens = rows(work, partition, "tokens")
        responses = {row["id"]: row for row in rows(work, partition, "responses")}
        assert [s["input_ids"].tolist() for s in stored] == [t["input_ids"][:-1] for t in tokens]
        for sample, token in zip(stored, tokens, strict=True):
            last = [m for m in responses[token["id"]]["messages"] if m["role"] == "assistant"][-1]
            assert token["input_ids"][-len(last["output_ids"]) :] == last["output_ids"]  # cut: its last id
            assert sample["loss_mask"].tolist() == token["loss_mask"][:-1]
        index = json.loads((shards(work, partition)[0] / "index.json").read_text())
        largest, apart, count = against_prefill(stored, work / "results/demo/model", index["aux_layers"])
        worst, rounded_apart, values = max(worst, largest), rounded_apart + apart, values + count
        assert not list((work / f"results/{partition}/responses").glob("*.states"))
    assert list((work / "results/.one_pass").iterdir()) == []
    print(f"one-pass shards against transformers: largest difference {worst:.2e}, {rounded_apart} of {values} differ")
    assert rounded_apart < values / 1000  # a bf16 step apart where float32 sums fall across a rounding boundary


def test_the_probe_passes_and_both_exports_hold_every_sample(one_pass_run):
    for partition, count in PARTITIONS.items():
        probe = json.loads((one_pass_run / f"results/report/{partition}.json").read_text())["probe"]
        assert probe["verdicts"] == {"ok": count} and probe["last_turn"]["top1_agreement"] >= 0.98
        stored = sum(1 for shard in shards(one_pass_run, partition) for _ in HiddenShard(shard))
        for name in ("speculators", "specforge"):
            summary = json.loads((one_pass_run / f"results/{partition}/export/{name}/export.json").read_text())
            assert summary["samples"] == stored > 0
