"""The workflow end to end with SGLang doing the model's work: `inference.backend: sglang` (one launched
`sglang.launch_server` serving every partition) and `hidden_states.backend: sglang` (SGLang's model
runner under torchrun), on the CPU, nothing stood in.

Snakemake and the CPU stages run in the project's venv as a user's run does; only the server and the
torchrun ranks run in .venv-sglang, through two small wrappers that set the CPU settings of conftest.
"""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from eagle3_datagen.chat.template import load_tokenizer, render_ids
from eagle3_datagen.formats.files import read_jsonl
from eagle3_datagen.formats.hidden_shard import HiddenShard

from ..conftest import REPO, copy_workflow
from .conftest import CPU_CAPTURE_SETTINGS, CPU_LAUNCH_ARGS, SGLANG_CPU_ENV

PARTITIONS = {"demo_sharegpt": 2, "demo_alpaca": 1}
MAIN_VENV_BIN = REPO / ".venv" / "bin"


def wrapper(path: Path, target: str) -> Path:
    """An executable that runs `target` from .venv-sglang with SGLang's CPU settings (its shims
    on PYTHONPATH only there: the project's own processes never see them)."""
    exports = "".join(f"export {key}='{value}'\n" for key, value in SGLANG_CPU_ENV.items())
    path.write_text(f'#!/bin/sh\n{exports}exec "{Path(sys.executable).parent / target}" "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture(scope="module")
def sglang_run(tmp_path_factory):
    work = copy_workflow(tmp_path_factory.mktemp("sglang-workflow") / "wf")
    bin_dir = work / "sglang-bin"
    bin_dir.mkdir()
    wrapper(bin_dir / "torchrun", "torchrun")
    server_python = wrapper(bin_dir / "sglang-python", "python")
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    config["partitions"] = {name: config["partitions"][name] for name in PARTITIONS}
    config["resources"]["gpus_per_node"] = 1  # one rank: torchrun --nproc-per-node 1
    config["inference"]["backend"] = "sglang"
    config["inference"]["sglang"] = {
        "url": f"http://127.0.0.1:{22000 + os.getpid() % 1000}",
        "launch": {"command": [str(server_python), "-m", "sglang.launch_server"], "args": CPU_LAUNCH_ARGS},
    }
    config["hidden_states"].update(
        backend="sglang", max_batch_tokens=512, sglang={**CPU_CAPTURE_SETTINGS, "device": "cpu"}
    )
    (work / "sglang.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "PATH": f"{bin_dir}:{MAIN_VENV_BIN}:{os.environ['PATH']}"}
    for key in [*SGLANG_CPU_ENV, "PYTHONDONTWRITEBYTECODE"]:
        env.pop(key, None)
    proc = subprocess.run(
        [str(MAIN_VENV_BIN / "snakemake"), "--profile", "local", "--configfile", "sglang.yaml"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        logs = "\n".join(f"== {p}\n{p.read_text()[-2000:]}" for p in sorted((work / "logs").rglob("*.log")))
        pytest.fail(f"snakemake failed:\n{proc.stderr[-4000:]}\n{logs[-12000:]}")
    return work


def rows(work, partition, stage):
    return [
        row
        for shard in range(PARTITIONS[partition])
        for row in read_jsonl(work / f"results/{partition}/{stage}/{shard:05d}.jsonl.zst")
    ]


def test_one_server_answered_every_partition_with_greedy_ids(sglang_run):
    from transformers import AutoModelForCausalLM

    model_dir = sglang_run / "results/demo/model"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(model_dir)
    template_kwargs = {"enable_thinking": False}
    server_log = (sglang_run / "logs/sglang_server/server.log").read_text()
    assert server_log.count("Uvicorn running") == 1 or server_log.count("The server is fired up") == 1
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    checked = 0
    for partition in PARTITIONS:
        for row in rows(sglang_run, partition, "responses"):
            messages = row["messages"]
            first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
            turn = messages[first]
            assert turn["produced_by"]["backend"] == "sglang" and turn["finish_reason"] == "stop"
            assert turn["produced_by"]["finish_reason"] == {"type": "stop", "matched": end_of_turn}
            prompt_ids = render_ids(tokenizer, messages[:first], True, template_kwargs)
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=48, do_sample=False)
            assert turn["output_ids"] == out[0, len(prompt_ids) :].tolist()
            checked += 1
    assert checked == len(rows(sglang_run, "demo_sharegpt", "prompts") + rows(sglang_run, "demo_alpaca", "prompts")) > 0


def test_tokens_are_the_server_ids_never_a_semantic_mismatch(sglang_run):
    for partition, shards in PARTITIONS.items():
        for shard in range(shards):
            audit = json.loads((sglang_run / f"results/{partition}/tokens/{shard:05d}.audit.json").read_text())
            compared, kinds = audit["audit"]["turns_compared"], audit["audit"]
            # bpe_only: the tiny model emits the same text in other token splits than the tokenizer's own.
            assert compared == audit["counts"]["ids_from_server"] > 0 and kinds["semantic"] == 0
            assert kinds["exact"] + kinds["bpe_only"] == compared


def test_hidden_states_are_sglang_captures_equal_to_transformers(sglang_run):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(sglang_run / "results/demo/model", dtype=torch.float32).eval()
    for partition, shards in PARTITIONS.items():
        tokens = rows(sglang_run, partition, "tokens")
        stored = [
            s for shard in range(shards) for s in HiddenShard(sglang_run / f"results/{partition}/hidden/{shard:05d}")
        ]
        assert [s["id"] for s in stored] == [t["id"] for t in tokens]
        index = json.loads((sglang_run / f"results/{partition}/hidden/00000/index.json").read_text())
        sample = stored[0]
        with torch.no_grad():
            out = model(sample["input_ids"][None].long(), output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i][0] for i in index["aux_layers"]], dim=-1)
        torch.testing.assert_close(sample["aux_hidden_states"].float(), aux, atol=2e-2, rtol=1e-2)
        probe = json.loads((sglang_run / f"results/report/{partition}.json").read_text())["probe"]
        assert probe["verdicts"] == {"ok": shards} and probe["last_turn"]["top1_agreement"] >= 0.98
    assert (sglang_run / "results/report/summary.html").stat().st_size > 0
