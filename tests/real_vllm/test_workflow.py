"""The workflow end to end with vLLM doing the model's work: `inference.backend: vllm` (one launched
`vllm.entrypoints.openai.api_server` on the node, shared by every shard job) and `hidden_states.backend:
vllm` (vLLM's engine with `extract_hidden_states` in the node's capture runner), on the CPU, nothing
stood in, through the probe and both trainers' exports. One run serves the module.

Snakemake and the CPU stages run in the project's venv as a user's run does; the server and the capture
runner run in .venv-vllm, named by the two settings a user gives for it: `inference.vllm.launch.command`
and `hidden_states.runner.python`. The demo model is built first (two heads of 32: vLLM's CPU attention
needs head_dim >= 32; conftest.py builds it once for the tier's workflow runs) and then named as a production
model directory, as tests/real_sglang/test_workflow.py does.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from eagle3_datagen.backends.hf.capture import HFCapture
from eagle3_datagen.chat.template import load_tokenizer, render_ids
from eagle3_datagen.formats.files import read_jsonl
from eagle3_datagen.formats.hidden_shard import HiddenShard
from eagle3_datagen.formats.trainer_exports import EXPORTS
from tests.helpers import REPO, copy_workflow, free_port
from tests.helpers.sglang_cpu import greedy

PARTITIONS = {"demo_sharegpt": 2, "demo_alpaca": 1}
MAIN_VENV_BIN = REPO / ".venv" / "bin"
MAX_MODEL_LEN = 2048  # tokens.max_length: a trained sample fits the engine's context
# bf16 storage (the demo's hidden_states.dtype) of float32 states: a stored value is within half a bf16 step
# (2^-8 relative) of vLLM's, which is within 1e-4 of transformers' (tests/helpers/vllm_cpu.TOLERANCE)
STORED = {"atol": 1e-3, "rtol": 2**-8 + 1e-4}


def snakemake_run(work: Path, config: str, *args: str) -> None:
    proc = subprocess.run(
        [str(MAIN_VENV_BIN / "snakemake"), *args, "--profile", "local", "--resources", "gpu=2", "--configfile", config],
        cwd=work,
        env={**os.environ, "PATH": f"{MAIN_VENV_BIN}:{os.environ['PATH']}"},
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        logs = "\n".join(f"== {p}\n{p.read_text()[-2000:]}" for p in sorted((work / "logs").rglob("*.log")))
        pytest.fail(f"snakemake failed:\n{proc.stderr[-4000:]}\n{logs[-12000:]}")


def demo_config() -> dict:
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    config["demo"]["num_heads"] = config["demo"]["num_kv_heads"] = 2  # head_dim 32
    return config


def run_config() -> dict:
    config = demo_config()
    config["partitions"] = {name: {**config["partitions"][name], "shards": n} for name, n in PARTITIONS.items()}
    del config["demo"]  # the model built by the first step, as a production directory
    del config["evaluate"]  # the drafts trained on the exports: tests/trainers
    config["resources"]["gpus_per_node"] = 2  # two shard jobs share the server (launch.shard_jobs: 2)
    engine = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager"]
    config["inference"]["backend"] = "vllm"
    config["inference"]["vllm"] = {
        "url": f"http://127.0.0.1:{free_port()}",
        # .venv-vllm's interpreter: this test's own
        "launch": {"command": [sys.executable, "-m", "vllm.entrypoints.openai.api_server"], "args": engine},
    }
    config["hidden_states"].update(
        backend="vllm",
        max_batch_tokens=512,
        runner={"python": sys.executable},
        vllm={"dtype": "float32", "engine_args": {"max_model_len": MAX_MODEL_LEN, "enforce_eager": True}},
    )
    return config


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory, demo_results):
    work = copy_workflow(tmp_path_factory.mktemp("vllm-workflow") / "wf")
    shutil.copytree(demo_results, work / "results" / "demo")  # conftest.py builds it once for the tier
    (work / "vllm.yaml").write_text(yaml.safe_dump(run_config()))
    snakemake_run(work, "vllm.yaml")
    return work


def rows(work: Path, partition: str, stage: str) -> list[dict]:
    return [
        row
        for shard in range(PARTITIONS[partition])
        for row in read_jsonl(work / f"results/{partition}/{stage}/{shard:05d}.jsonl.zst")
    ]


def shards(work: Path, partition: str) -> list[Path]:
    return [work / f"results/{partition}/hidden/{shard:05d}" for shard in range(PARTITIONS[partition])]


@pytest.fixture(scope="module")
def model(vllm_run):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(vllm_run / "results/demo/model", dtype=torch.float32).eval()


def assistant_turns(messages: list[dict]) -> list[int]:
    return [i for i, m in enumerate(messages) if m["role"] == "assistant"]


def test_one_launched_server_answered_every_turn_with_the_greedy_ids(vllm_run, model):
    """Every assistant turn (a multi-turn record's later ones after the earlier answers) is the server's
    greedy answer to the template's rendering of what precedes it, which transformers reproduces."""
    tokenizer = load_tokenizer(vllm_run / "results/demo/model")
    server_log = (vllm_run / "logs/server/server.log").read_text()
    assert server_log.count("starting the vLLM server") == 1 and f"{sys.executable} -m " in server_log
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    answered, stopped = 0, 0
    for partition in PARTITIONS:
        for row in rows(vllm_run, partition, "responses"):
            for k in assistant_turns(row["messages"]):
                turn = row["messages"][k]
                assert turn["produced_by"]["backend"] == "vllm"
                prompt_ids = render_ids(tokenizer, row["messages"][:k], True, {"enable_thinking": False})
                output = turn["output_ids"]
                finish = turn["produced_by"]["finish_reason"]
                if finish["type"] == "stop":
                    # <|im_end|> is the model's EOS, which vLLM's stop_reason leaves None, its id kept
                    assert output[-1] == end_of_turn and finish["matched"] in (None, end_of_turn)
                    stopped += 1
                with torch.no_grad():
                    assert output == greedy(model, prompt_ids, len(output))
            answered += 1
    assert answered == sum(len(rows(vllm_run, p, "prompts")) for p in PARTITIONS) > 0 and stopped > answered // 2


def trained_runs(ids: list[int], loss_mask: list[int]) -> list[list[int]]:
    """The ids of each run of trained positions."""
    runs, start = [], None
    for i, trained in enumerate([*loss_mask, 0]):
        if trained and start is None:
            start = i
        elif not trained and start is not None:
            runs.append(ids[start:i])
            start = None
    return runs


def test_tokens_are_the_templates_rendering_around_the_servers_ids(vllm_run):
    """Each sample is its conversation as the chat template renders it: the last turn's generation prompt,
    then the ids the server returned for it; the trained spans are the ids the server returned for each of
    its turns (an earlier one as the template renders it in the history, without the generation prompt's
    empty think block); the audit compared every turn with its ids and found none that differs in meaning."""
    tokenizer = load_tokenizer(vllm_run / "results/demo/model")
    for partition, count in PARTITIONS.items():
        responses = {row["id"]: row["messages"] for row in rows(vllm_run, partition, "responses")}
        samples = rows(vllm_run, partition, "tokens")
        assert samples
        for sample in samples:
            messages, ids = responses[sample["id"]], sample["input_ids"]
            *earlier, last = assistant_turns(messages)
            prompt = render_ids(tokenizer, messages[:last], True, {"enable_thinking": False})
            assert ids == prompt + messages[last]["output_ids"]
            assert trained_runs(ids, sample["loss_mask"]) == [messages[k]["output_ids"] for k in [*earlier, last]]
        for shard in range(count):
            audit = json.loads((vllm_run / f"results/{partition}/tokens/{shard:05d}.audit.json").read_text())
            compared = audit["audit"]["turns_compared"]
            assert compared == audit["counts"]["ids_from_server"] > 0 and audit["audit"]["semantic"] == 0


def test_states_are_vllms_captures_of_the_token_ids_equal_to_transformers(vllm_run):
    """One capture runner in .venv-vllm captured every shard; its states, stored bf16, are transformers'
    states of the same ids rounded to bf16 but where vLLM's float32 sums fall on the other side of a
    rounding boundary (96 of 541,184 values when measured), there one bf16 step off."""
    runner_log = (vllm_run / "logs/capture_runner/runner.log").read_text()
    assert runner_log.count("starting the capture runner") == 1 and f"{sys.executable} " in runner_log
    lines = [line for line in runner_log.splitlines() if " capturing " in line]
    captured = sorted(line.split(" into ")[1].split(" for job")[0] for line in lines)
    assert [Path(p).relative_to(vllm_run.resolve()).as_posix() for p in captured] == [
        f"results/{p}/hidden/{s:05d}" for p, n in sorted(PARTITIONS.items()) for s in range(n)
    ]
    model_dir = vllm_run / "results/demo/model"
    worst, rounded_apart, values = 0.0, 0, 0
    for partition in PARTITIONS:
        stored = [sample for shard in shards(vllm_run, partition) for sample in HiddenShard(shard)]
        tokens = rows(vllm_run, partition, "tokens")
        assert [s["input_ids"].tolist() for s in stored] == [t["input_ids"] for t in tokens]
        index = json.loads((shards(vllm_run, partition)[0] / "index.json").read_text())
        assert (index["final"], index["dtype"]) == ("raw", "bfloat16")
        largest, apart, count = against_prefill(stored, model_dir, index["aux_layers"])
        worst, rounded_apart, values = max(worst, largest), rounded_apart + apart, values + count
    print(f"stored states against transformers': largest difference {worst:.2e}, {rounded_apart} of {values} differ")
    assert rounded_apart < values / 1000


def against_prefill(stored: list[dict], model_dir: Path, aux_layers: list[int]) -> tuple[float, int, int]:
    """Stored samples against a transformers prefill (float32) of their ids, each value within STORED: the
    largest difference, how many values are not the prefill's rounded to bf16, and how many were compared."""
    reference = HFCapture(model_dir, aux_layers, "raw", {"dtype": "float32", "device": "cpu"})
    expected = reference([sample["input_ids"].tolist() for sample in stored])
    worst, rounded_apart, values = 0.0, 0, 0
    for sample, (aux, final) in zip(stored, expected, strict=True):
        for ours, theirs in ((sample["aux_hidden_states"], aux), (sample["hidden_states"], final)):
            torch.testing.assert_close(ours.float(), theirs, **STORED)
            worst = max(worst, (ours.float() - theirs).abs().max().item())
            rounded_apart += (ours != theirs.to(torch.bfloat16)).sum().item()
            values += ours.numel()
    return worst, rounded_apart, values


def test_the_probe_passes_every_shard(vllm_run):
    for partition, count in PARTITIONS.items():
        probe = json.loads((vllm_run / f"results/report/{partition}.json").read_text())["probe"]
        assert probe["verdicts"] == {"ok": count} and probe["last_turn"]["top1_agreement"] >= 0.98


def test_both_exports_hold_the_shards_states_as_their_trainers_read_them(vllm_run, model):
    """Each export's files are those its trainer's reader opens (tests/trainers runs the readers themselves:
    speculators' ArrowDataset, SpecForge's OfflineManifestReader); read back as the layer check reads them,
    speculators' hold the stored states bit for bit, SpecForge's the final slot after the model's norm."""
    for partition in PARTITIONS:
        stored = [sample for shard in shards(vllm_run, partition) for sample in HiddenShard(shard)]
        for name in ("speculators", "specforge"):
            export = vllm_run / f"results/{partition}/export/{name}"
            summary = json.loads((export / "export.json").read_text())
            assert summary["samples"] == len(stored) and summary["final_norm_applied"] is (name == "specforge")
        speculators = vllm_run / f"results/{partition}/export/speculators"
        assert sorted(p.name for p in (speculators / "hidden_states").iterdir()) == sorted(
            f"hs_{i}.safetensors" for i in range(len(stored))
        )
        for i, sample in enumerate(stored):
            aux, final = EXPORTS["speculators"].read_slots(speculators, i)
            assert torch.equal(aux, sample["aux_hidden_states"]) and torch.equal(final, sample["hidden_states"])
            aux, final = EXPORTS["specforge"].read_slots(vllm_run / f"results/{partition}/export/specforge", i)
            assert torch.equal(aux, sample["aux_hidden_states"])
            with torch.no_grad():
                normed = model.model.norm(sample["hidden_states"].float())
            torch.testing.assert_close(final.float(), normed, **STORED)
