"""The workflow end to end with SGLang doing the model's work: `inference.backend: sglang` (one launched
`sglang.launch_server` on the node, shared by every shard job) and `hidden_states.backend: sglang`
(SGLang's model runner under torchrun, one capture runner shared by every shard job), on the CPU,
nothing stood in; locally, and one partition of the same run under `--profile slurm` on the SLURM test cluster.

Snakemake and the CPU stages run in the project's venv as a user's run does; only the server and the
torchrun ranks run in .venv-sglang, through two small wrappers that set the CPU settings of conftest.
The demo model is built first and then named as a production model directory, so that adding a
partition does not refit it (the demo fits its model to every partition).
"""

import base64
import json
import os
import re
import shutil
import signal
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
from tests.helpers import REPO, copy_workflow, wait_until
from tests.helpers.sglang_cpu import CPU_CAPTURE_SETTINGS, CPU_LAUNCH_ARGS, SGLANG_CPU_ENV

from ..slurm import NODE_SIZED, SLURM_ARGS, sacct_jobs, without_timings

# Two partitions, three shards: shards of one partition and of two share the node's server and runner.
PARTITIONS = {"demo_sharegpt": 2, "demo_alpaca": 1}
SHARDS = sum(PARTITIONS.values())
# The SLURM run: one partition's two shards, a group job of two shard jobs per GPU stage (what SLURM runs
# differently is per job and allocation, not per partition), compared with the local run's.
SLURM_PARTITIONS = {"demo_sharegpt": 2}
SLURM_SHARDS = sum(SLURM_PARTITIONS.values())
ADDED = {"demo_openai": 2}
SERVER_STARTED = "starting the SGLang server"
RUNNER_STARTED = "starting the capture runner"
MAIN_VENV_BIN = REPO / ".venv" / "bin"


def wrapper(path: Path, target: str, **env: str) -> Path:
    """An executable that runs `target` from .venv-sglang with SGLang's CPU settings and `env` (its
    shims on PYTHONPATH only there: the project's own processes never see them)."""
    exports = "".join(f"export {key}='{value}'\n" for key, value in {**SGLANG_CPU_ENV, **env}.items())
    path.write_text(f'#!/bin/sh\n{exports}exec "{Path(sys.executable).parent / target}" "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def snakemake_env(work: Path) -> dict:
    env = {**os.environ, "PATH": f"{work / 'sglang-bin'}:{MAIN_VENV_BIN}:{os.environ['PATH']}"}
    for key in [*SGLANG_CPU_ENV, "PYTHONDONTWRITEBYTECODE"]:
        env.pop(key, None)
    return env


# The node's two "GPUs": the shard jobs and the capture jobs each take both (as on the 8-GPU node).
GPUS = 2
SNAKEMAKE = ["--profile", "local", "--resources", f"gpu={GPUS}", "--configfile"]


def snakemake_run(work: Path, config: str, *args: str, check=True, profile=SNAKEMAKE) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(MAIN_VENV_BIN / "snakemake"), *args, *profile, config],  # --configfile takes every word after it
        cwd=work,
        env=snakemake_env(work),
        capture_output=True,
        text=True,
    )
    if check and proc.returncode != 0:
        logs = "\n".join(f"== {p}\n{p.read_text()[-2000:]}" for p in sorted((work / "logs").rglob("*.log")))
        pytest.fail(f"snakemake failed:\n{proc.stderr[-4000:]}\n{logs[-12000:]}")
    return proc


def run_config(partitions: dict) -> dict:
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    config["partitions"] = {name: {**config["partitions"][name], "shards": n} for name, n in partitions.items()}
    del config["demo"]  # the model built by the first step, as a production directory
    # what the SGLang server and capture runner make is under test, not the drafts trained on it (the
    # evaluate stage: tests/workflow/test_workflow.py, tests/trainers)
    del config["evaluate"]
    # the capture runner's tensor-parallel size: torchrun --nproc-per-node 2 (the server keeps TP 1: its args)
    config["resources"]["gpus_per_node"] = GPUS
    config["inference"]["backend"] = "sglang"
    config["inference"]["sglang"] = {
        # one port for every run of the module: the runs' outputs, which record it, are compared
        "url": f"http://127.0.0.1:{22000 + os.getpid() % 1000}",
        "launch": {
            "command": ["sglang-bin/sglang-python", "-m", "sglang.launch_server"],
            "args": CPU_LAUNCH_ARGS,
            "idle_timeout": 600,
        },
        "tiers": {"short": {"concurrency": 4}, "long": {"concurrency": 2}},
    }
    config["hidden_states"].update(
        backend="sglang", max_batch_tokens=512, sglang={**CPU_CAPTURE_SETTINGS, "device": "cpu"}
    )
    return config


def sglang_workflow(parent: Path) -> Path:
    """A copy of the workflow whose launched server and capture runner run in .venv-sglang."""
    work = copy_workflow(parent / "wf")
    bin_dir = work / "sglang-bin"
    bin_dir.mkdir()
    # one core per rank: SGLang's CPU path otherwise allows one rank per NUMA node
    wrapper(bin_dir / "torchrun", "torchrun", SGLANG_CPU_OMP_THREADS_BIND="0|1")
    wrapper(bin_dir / "sglang-python", "python")
    return work


@pytest.fixture(scope="module")
def sglang_run(tmp_path_factory):
    work = sglang_workflow(tmp_path_factory.mktemp("sglang-workflow"))
    demo = yaml.safe_load((REPO / "config.yaml").read_text())
    (work / "demo.yaml").write_text(yaml.safe_dump(demo))
    snakemake_run(work, "demo.yaml", "results/demo/model")
    (work / "sglang.yaml").write_text(yaml.safe_dump(run_config(PARTITIONS)))
    snakemake_run(work, "sglang.yaml")
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
    server_log = (sglang_run / "logs/server/server.log").read_text()
    # 3 shard jobs, one server: started once, and stopped for the first capture job (the node's GPUs)
    assert server_log.count(SERVER_STARTED) == 1 and server_log.count("The server is fired up") == 1
    assert server_log.count("no job uses the SGLang server; stopping it") == 1
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


def test_one_capture_runner_loaded_once_captured_every_shard(sglang_run):
    """3 hidden-state jobs, one runner: SGLang's model runner under torchrun, loaded once, its ranks kept
    alive from shard to shard; started after the generation server stopped, stopped at the run's end."""
    runner_log = (sglang_run / "logs/capture_runner/runner.log").read_text()
    assert runner_log.count(RUNNER_STARTED) == 1 and runner_log.count("capture runner ready after") == 1
    assert runner_log.count("capture runner loaded") == 1  # rank 0's log line, once per load
    loads = {name: read_jsonl(sglang_run / f"logs/{name}/loads.jsonl") for name in ("server", "capture_runner")}
    model = str((sglang_run / "results/demo/model").resolve())
    assert {name: [(r["service"], r["model"]) for r in records] for name, records in loads.items()} == {
        "server": [("generation_server", model)],
        "capture_runner": [("capture_runner", model)],
    }  # each load recorded once, for the plan
    lines = [line for line in runner_log.splitlines() if " capturing " in line]
    captured = [line.split(" into ")[1].split(" for job")[0] for line in lines]
    assert sorted(Path(p).relative_to(sglang_run).as_posix() for p in captured) == [
        f"results/{p}/hidden/{s:05d}" for p, n in sorted(PARTITIONS.items()) for s in range(n)
    ]
    assert f"torchrun --standalone --nproc-per-node {GPUS}" in runner_log
    assert runner_log.count("no job uses the capture runner; stopping it") == 1


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


def fingerprints(work: Path, partitions: dict) -> dict[str, tuple[int, int]]:
    """(mtime ns, size) of every finished responses, hidden-state and log file of `partitions`."""
    paths = [
        path
        for partition in partitions
        for pattern in ("results/{p}/responses/*", "results/{p}/hidden/*/index.json", "logs/{p}/responses/*")
        for path in work.glob(pattern.format(p=partition))
    ]
    return {str(p.relative_to(work)): (p.stat().st_mtime_ns, p.stat().st_size) for p in paths}


def test_an_added_partition_and_a_kill_9_regenerate_no_finished_shard(sglang_run):
    """After the first run: a third partition is generated alone, by one more server start, and a
    run killed with -9 after its first shard keeps that shard when rerun."""
    work = sglang_run
    finished = fingerprints(work, PARTITIONS)
    (work / "added.yaml").write_text(yaml.safe_dump(run_config({**PARTITIONS, **ADDED})))
    dry = snakemake_run(work, "added.yaml", "-n").stdout
    jobs = [(b.split(":", 1)[0].strip(), b) for b in re.split(r"\n\s*rule ", dry)[1:]]  # a group's, indented
    responses = [b for rule, b in jobs if rule == "responses_served"]
    assert len(responses) == 2 and all("partition=demo_openai" in b for b in responses)
    assert not any(f"partition={p}" in b for _, b in jobs for p in PARTITIONS)

    first = work / "results/demo_openai/responses/00000.jsonl.zst"
    outputs = [str(p.relative_to(work)) for p in (first, first.with_name("00000.stats.json"))]

    def finished_first() -> bool:
        """The first shard finished as Snakemake counts it: each output's record written, then every output's
        incomplete marker removed (Snakemake 9 writes the records one by one, then removes the markers: a
        -9 between the two leaves the job incomplete, which a rerun regenerates; so does an output file alone,
        a job still in flight)."""
        keys = [base64.urlsafe_b64encode(o.encode()).decode() for o in outputs]
        return all((work / ".snakemake/metadata" / k).exists() for k in keys) and not any(
            (work / ".snakemake/incomplete" / k).exists() for k in keys
        )

    run = subprocess.Popen(
        [str(MAIN_VENV_BIN / "snakemake"), *SNAKEMAKE, "added.yaml"],
        cwd=work,
        env=snakemake_env(work),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    wait_until(lambda: finished_first() or run.poll() is not None, timeout=900, interval=0.2)
    assert finished_first(), "the first shard of the added partition never finished"
    os.killpg(run.pid, signal.SIGKILL)  # Snakemake and its jobs; the server's supervisor is its own session
    run.wait()
    kept = fingerprints(work, ADDED)
    snakemake_run(work, "added.yaml", "--unlock")
    snakemake_run(work, "added.yaml")

    after = fingerprints(work, {**PARTITIONS, **ADDED})
    assert {k: after[k] for k in finished} == finished  # no finished shard of the first run touched
    shard0 = [k for k in kept if "/00000" in k]
    assert shard0 and {k: after[k] for k in shard0} == {k: kept[k] for k in shard0}
    server_log = (work / "logs/server/server.log").read_text()
    # one start for the first run, one for the added partition: the rerun after the kill used the
    # server that outlived it
    assert server_log.count(SERVER_STARTED) == 2
    # the added partition's shards, and only those, captured by one more runner
    runner_log = (work / "logs/capture_runner/runner.log").read_text()
    assert runner_log.count(RUNNER_STARTED) == 2
    later = runner_log.split(RUNNER_STARTED)[2]
    assert sorted(line.split(" into ")[1].split("/results/")[1].split(" ")[0] for line in later.splitlines()
                  if "capturing " in line) == ["demo_openai/hidden/00000", "demo_openai/hidden/00001"]  # fmt: skip
    rows_added = [r for s in range(2) for r in read_jsonl(work / f"results/demo_openai/responses/{s:05d}.jsonl.zst")]
    prompts_added = [r for s in range(2) for r in read_jsonl(work / f"results/demo_openai/prompts/{s:05d}.jsonl.zst")]
    assert [r["id"] for r in rows_added] == [p["id"] for p in prompts_added]


# The SLURM tests last: the machine's one test cluster (tests/slurm) is held from the first test that
# asks for it to the module's end, and `make test`'s other run waits for it meanwhile.
@pytest.fixture(scope="module")
def slurm_run(sglang_run, slurm_cluster, tmp_path_factory):
    """The local run's GPU stages for SLURM_PARTITIONS under `--profile slurm` on the test cluster
    (tests/slurm), from the same model: (work directory, the run's SLURM jobs)."""
    work = sglang_workflow(tmp_path_factory.mktemp("sglang-slurm"))
    # The same model and prompts: what SLURM runs differently are the GPU stages (tests/slurm/test_slurm.py runs
    # prompts jobs there and compares them with a local run's)
    shutil.copytree(sglang_run / "results/demo/model", work / "results/demo/model")
    for partition in SLURM_PARTITIONS:
        shutil.copytree(sglang_run / f"results/{partition}/prompts", work / f"results/{partition}/prompts")
    config = run_config(SLURM_PARTITIONS)
    config["resources"].update(NODE_SIZED["resources"])  # job sizes the test node has, its GPUs as locally
    (work / "slurm.yaml").write_text(yaml.safe_dump(config))
    before = {job["id"] for job in sacct_jobs()}
    targets = [f"results/{p}/hidden/{s:05d}" for p, n in SLURM_PARTITIONS.items() for s in range(n)]
    snakemake_run(work, "slurm.yaml", *targets, profile=[*SLURM_ARGS, "--configfile"])
    return work, [job for job in sacct_jobs() if job["id"] not in before]


def test_under_slurm_each_model_loads_once_per_allocation_in_a_step_of_its_own(slurm_run):
    """The 2 shard jobs of each GPU stage are one group job (the slurm profile): one allocation on the
    gpu partition, whose jobs run one after another in its batch step (jobs that launch their own
    processes, one per GPU), beside the server's (or the runner's) own job step, which outlives each."""
    work, jobs = slurm_run
    assert all(job["state"] == "COMPLETED" for job in jobs), jobs
    ran = sorted(job["comment"].split("_wildcards")[0] for job in jobs)
    assert ran == ["rule_capture_hidden_states", "rule_generation_responses_served", *["rule_tokens"] * SLURM_SHARDS]
    groups = {job["comment"]: job for job in jobs if job["partition"] == "gpu"}
    assert sorted(groups) == ["rule_capture_hidden_states", "rule_generation_responses_served"], jobs
    for comment, name, log in [
        ("rule_generation_responses_served", "SGLang server", "server/server"),
        ("rule_capture_hidden_states", "capture runner", "capture_runner/runner"),
    ]:
        allocation = groups[comment]
        assert f"gres/gpu={GPUS}" in allocation["tres"] and "node=1" in allocation["tres"], allocation
        steps = [s for s in sacct_jobs(allocation["id"], steps=True) if s["id"].partition(".")[2].isdigit()]
        assert [s["name"] for s in steps] == [name.replace(" ", "-")], steps  # the service's step alone
        text = (work / f"logs/{log}.slurm-{allocation['id']}.log").read_text()
        step = steps[0]["id"].split(".")[1]
        assert text.count(f"starting the {name}") == 1
        assert f"starting the {name} on {allocation['node']} (SLURM job {allocation['id']}, step {step})" in text
        assert text.count(f"{name} ready after") == 1
        assert len(read_jsonl(work / f"logs/{log.split('/')[0]}/loads.slurm-{allocation['id']}.jsonl")) == 1


def test_under_slurm_the_outputs_equal_the_local_runs(slurm_run, sglang_run):
    work, _ = slurm_run
    here, there = str(work.resolve()), str(sglang_run.resolve())
    for partition, shards in SLURM_PARTITIONS.items():
        for shard in range(shards):
            for stage in ("prompts", "responses", "tokens"):
                name = f"results/{partition}/{stage}/{shard:05d}.jsonl.zst"
                assert read_jsonl(work / name) == read_jsonl(sglang_run / name), name
            stats = f"results/{partition}/responses/{shard:05d}.stats.json"
            slurm_stats, local_stats = (
                json.loads((d / stats).read_text().replace(here, there)) for d in (work, sglang_run)
            )
            assert without_timings(slurm_stats) == without_timings(local_stats), stats
            hidden = Path(f"results/{partition}/hidden/{shard:05d}")
            parts = sorted(p.name for p in (sglang_run / hidden).glob("part-*"))
            assert parts and sorted(p.name for p in (work / hidden).glob("part-*")) == parts
            for part in parts:
                assert (work / hidden / part).read_bytes() == (sglang_run / hidden / part).read_bytes(), hidden / part
            index = [json.loads((d / hidden / "index.json").read_text()) for d in (work, sglang_run)]
            assert without_timings(index[0]) == without_timings(index[1])
