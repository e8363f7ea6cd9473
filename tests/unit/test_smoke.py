"""The smoke run's own logic (diagnostics/smoke.py): its config, the steps and times it announces, and the
GPUs handed over between its steps, each a process of its own (the whole run on the tiny Kimi:
tests/workflow/test_tiny_kimi.py)."""

import json
import os
import subprocess
import sys
import time
from io import StringIO

import pytest
import torch
import yaml

from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.diagnostics.model_slice import ENGINE_SHARE
from eagle3_datagen.diagnostics.smoke import Smoke, format_planned, planned_steps, smoke_config
from eagle3_datagen.formats.checkpoint import tensor_bytes
from eagle3_datagen.formats.measured_rates import write_rates
from eagle3_datagen.workflow.settings import sampling_for
from tests.helpers import REPO, tiny_qwen3


def tiny_kimi(**inference) -> dict:
    config = yaml.safe_load((REPO / "config/tiny-kimi.yaml").read_text())
    config["inference"].update(inference)
    return fill_defaults(config)


def test_every_backends_sampling_is_greedy_in_the_smoke_config(tmp_path):
    """A backend's own `sampling` replaces inference.sampling's keys: the smoke run sets both."""
    config = tiny_kimi(
        sampling={"max_new_tokens": 64, "temperature": 0.6},
        hf={"batch_size": 16, "dtype": "float32", "device": "cpu", "sampling": {"temperature": 1.0, "top_p": 0.95}},
        openrouter={"model": "moonshotai/kimi-k2.5", "sampling": {"temperature": 1.0}},
    )
    assert sampling_for(config, "hf")["temperature"] == 1.0
    smoke = fill_defaults(smoke_config(config, ["tiny_chat"], 5, 3, tmp_path))
    for backend in ("hf", "openrouter", "sglang"):
        assert sampling_for(smoke, backend)["temperature"] == 0.0
    assert sampling_for(smoke, "hf")["top_p"] == 0.95  # only the temperature changes
    assert config["inference"]["hf"]["sampling"]["temperature"] == 1.0  # the user's config is left alone
    assert smoke["partitions"]["tiny_chat"]["max_prompts"] == 5
    assert smoke["hidden_states"]["layer_check_samples"] == 3 and smoke["hidden_states"]["keep_shards"]
    # no baseline twins, unless asked (--baseline): then the config's own, the data curve's fractions with it
    assert (config["evaluate"]["baseline"], smoke["evaluate"]["baseline"]) == ("original", "none")
    kept = smoke_config(config, ["tiny_chat"], 5, 3, tmp_path, baseline=True)["evaluate"]
    assert (kept["baseline"], kept["fractions"]) == ("original", [0.5, 1.0])


def test_the_announced_steps_count_the_model_loads_and_minutes_from_the_plans_rates(tmp_path):
    config = tiny_kimi()
    smoke = fill_defaults(smoke_config(config, ["tiny_chat", "tiny_glaive"], 200, 4, tmp_path))
    unknown = planned_steps(smoke, config, tmp_path, gpus=0, gpu_bytes=0)
    assert {s.name: s.minutes for s in unknown}["workflow"] is None  # no rate configured or measured
    model = str((tmp_path / config["model"]["path"]).resolve())
    write_rates(tmp_path / "logs", {"model": model, "time": "t", "generate_tokens_per_s": 64.0,
                                    "prefill_tokens_per_s": 2048.0})  # fmt: skip
    (tmp_path / "logs/capture_runner").mkdir(parents=True)
    loads = [{"service": "capture_runner", "model": model, "seconds": s} for s in (30, 50)]
    (tmp_path / "logs/capture_runner/loads.jsonl").write_text("".join(json.dumps(r) + "\n" for r in loads))
    steps = {s.name: s for s in planned_steps(smoke, config, tmp_path, gpus=0, gpu_bytes=0)}
    assert list(steps) == ["workflow", "probe", "auxiliary layers", "draft", "measurements"]  # no GPU: no check
    workflow = steps["workflow"]
    assert workflow.loads == ["hf responses job (tiny_chat)", "hf responses job (tiny_glaive)", "capture runner"]
    # 3 loads of 40 s; 2 x 200 prompts x 64 new tokens at 64 tokens/s; 2 x 200 x 2048 tokens at 2048 tokens/s
    assert workflow.minutes * 60 == 3 * 40 + 2 * 200 + 2 * 200
    assert "capture_runner load measured, mean of 2" in workflow.basis
    assert all(steps[s].loads == [] and steps[s].minutes == 0 for s in ("probe", "auxiliary layers", "draft"))
    on_node = {s.name: s for s in planned_steps(smoke, config, tmp_path, gpus=8, gpu_bytes=8 * 80 * 2**30)}
    assert on_node["draft"].loads == ["EAGLE3 server (the target and the draft)"]
    assert on_node["draft"].minutes == 600 / 60  # plan.load_seconds' generation server
    printed = format_planned(list(on_node.values()))
    assert f"~{workflow.minutes:>6.1f} min  loads: hf responses job (tiny_chat)" in printed
    assert printed.splitlines()[-1].endswith(f"~{workflow.minutes + 10:>6.1f} min; 4 model loads")


def test_the_gpu_check_loads_the_slice_its_plan_announced_where_two_copies_do_not_fit(
    tmp_path, stand_in_nvidia_smi, monkeypatch
):
    """An 8-layer target on GPUs whose 40% one copy exceeds: the plan announces its first 7 layers, their
    share of the two loads' minutes, and the check's command asks for those 7 (diagnostics/model_slice.py)."""
    torch.manual_seed(0)
    model = tmp_path / "model"
    tiny_qwen3(64, num_layers=8).save_pretrained(model)
    sizes = tensor_bytes(model)
    layer_7 = sum(b for n, b in sizes.items() if n.startswith("model.layers.7."))
    total = sum(sizes.values())
    config = tiny_kimi()
    config["model"]["path"] = str(model)
    config["hidden_states"]["backend"] = "sglang"
    smoke = fill_defaults(smoke_config(config, ["tiny_chat"], 5, 3, tmp_path))
    gpu_bytes = int((total - layer_7 / 2) / ENGINE_SHARE)  # the whole model is over 40%, 7 layers under
    steps = {s.name: s for s in planned_steps(smoke, config, tmp_path, gpus=2, gpu_bytes=gpu_bytes)}
    check = steps["GPU check"]
    assert check.process.startswith("torchrun, 8 ranks: scripts/gpu_check.py on the first 7 of 8 layers (")
    assert check.loads == ["SGLang model runner (TP 8)", "transformers"]  # resources.gpus_per_node
    share = (total - layer_7) / total
    assert check.minutes == pytest.approx(2 * 600 * share / 60)  # plan.load_seconds' capture runner, twice
    assert check.basis.startswith(f"2 x {share:.3g} x capture_runner load from plan.load_seconds")
    too_small = {s.name: s for s in planned_steps(smoke, config, tmp_path, gpus=2, gpu_bytes=1000)}["GPU check"]
    assert "scripts/gpu_check.py on nothing: even 7 layers" in too_small.process  # announced; the others go on

    stand_in_nvidia_smi([])  # two 81559 MiB GPUs
    run = Smoke(tmp_path, tmp_path, smoke, "profiles/local", StringIO())
    assert run.gpu_bytes == 2 * 81559 * 2**20
    run.gpu_bytes = gpu_bytes  # the plan's GPUs
    commands = []
    monkeypatch.setattr(run, "gpu_process", lambda what, command, log: commands.append(command) or 0)
    status, detail = run.gpu_check()
    assert status == "pass" and "the first 7 of 8 layers" in detail
    assert commands[0][commands[0].index("--layers") + 1] == "7"


def test_a_gpu_step_waits_for_the_memory_the_step_before_still_holds(tmp_path, stand_in_nvidia_smi, caplog):
    """The step before (another process, pid 4242) frees its memory 4 s late: the next step's process starts
    once nvidia-smi reports it free, and the smoke process itself holds none (it is no holder)."""
    freed_at = time.time() + 4
    stand_in_nvidia_smi([{"pid": 4242, "name": "python", "used": 70000, "gpu": "GPU-1", "freed_at": freed_at}])
    config = tiny_kimi()
    smoke = Smoke(tmp_path, tmp_path, config, "profiles/local", StringIO())
    assert smoke.gpus == 2
    caplog.set_level("INFO")
    started = tmp_path / "started"
    record_start = f"import time; open({str(started)!r}, 'w').write(repr(time.time()))"
    status = smoke.gpu_process("EAGLE3 server", [sys.executable, "-c", record_start], "step.log")
    assert status == 0 and float(started.read_text()) >= freed_at
    waiting = [r.getMessage() for r in caplog.records if "waiting for the GPUs' memory" in r.getMessage()]
    assert waiting and "held by pid 4242 (python, 70000 MiB on GPU 1)" in waiting[0]
    assert f"pid {os.getpid()}" not in " ".join(waiting)


def test_the_layer_check_loads_no_model():
    """The layer check, which runs in the smoke process, imports no transformers: it reads what the capture
    runner recorded (the steps that load the model are processes of their own)."""
    code = "import sys, eagle3_datagen.diagnostics.layer_check as c; c.check_layers;"
    code += "print(sorted(m for m in ('transformers', 'sglang') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
