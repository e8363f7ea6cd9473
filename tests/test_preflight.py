"""Preflight: what would fail a job later stops a real run before its first job and is a warning in a
dry-run (eagle3_datagen.workflow.preflight, called by the Snakefile)."""

import json
import os
import re
import sys
from pathlib import Path

import pytest
import yaml

from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.workflow.preflight import Job, config_jobs, problems

from .conftest import REPO, copy_workflow, run

KIMI_SOURCES = (
    "glaive-function-calling-v2.json",
    "magicoder-evol-instruct-110k.jsonl",
    "magicoder-oss-instruct-75k.jsonl",
)
VENV_BIN = str(Path(sys.executable).parent)


def kimi(name: str = "openrouter") -> dict:
    return yaml.safe_load((REPO / f"config/kimi-k2.5-{name}.yaml").read_text())


def model_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "tokenizer_config.json").write_text("{}")
    return path


def test_the_openrouter_key_and_model_are_needed_only_when_openrouter_responses_are_scheduled(tmp_path):
    config = kimi()
    config["model"]["path"] = str(model_dir(tmp_path / "model"))
    config["hidden_states"]["backend"] = "hf"
    env = {"PATH": VENV_BIN}
    [missing] = problems(config, [Job("responses", "B1_glaive")], env, False, tmp_path / "results")
    assert missing.startswith("$OPENROUTER_API_KEY is not set, and the responses of B1_glaive call OpenRouter")
    assert "export OPENROUTER_API_KEY=" in missing
    assert problems(config, [Job("responses", "B1_glaive")], {**env, "OPENROUTER_API_KEY": "k"}, False) == []
    # the responses are done: the rest of the run needs no key
    assert problems(config, [Job("tokens", "B1_glaive"), Job("hidden_states", "B1_glaive")], env, False) == []
    config["inference"]["openrouter"].update(api_key_env="TEAM_KEY")
    del config["inference"]["openrouter"]["model"]
    found = problems(config, [Job("responses", "B3_magicoder_oss")], env, False)
    assert [line.split(",")[0] for line in found] == [
        "$TEAM_KEY is not set",
        "inference.openrouter.model is not set",
    ]
    assert "B3_magicoder_oss" in found[1] and "moonshotai/kimi-k2.5" in found[1]


def test_a_model_directory_without_config_or_tokenizer_is_named(tmp_path):
    config = kimi()
    config["hidden_states"]["backend"] = "hf"
    env = {"PATH": VENV_BIN, "OPENROUTER_API_KEY": "k"}
    jobs = [Job("tokens", "B1_glaive")]
    config["model"]["path"] = str(tmp_path / "Kimi-K2.5")
    [found] = problems(config, jobs, env, False)
    assert found.startswith(f"model.path {tmp_path / 'Kimi-K2.5'} does not exist: set model.path")
    (tmp_path / "Kimi-K2.5").mkdir()
    (tmp_path / "Kimi-K2.5" / "tiktoken.model").write_text("")
    [found] = problems(config, jobs, env, False)
    assert f"{tmp_path / 'Kimi-K2.5'} has no config.json and no tokenizer.json or tokenizer_config.json" in found
    # prompts and reports read no model; the demo builds its own
    assert problems(config, [Job("prompts_B1_glaive"), Job("summary")], env, False) == []
    demo = fill_defaults(yaml.safe_load((REPO / "config.yaml").read_text()))
    demo["evaluate"]["python"] = sys.executable  # SpecForge's venv may not be built here
    assert problems(demo, config_jobs(demo), env, False) == []


def fake_sglang(tmp_path: Path) -> dict:
    """An importable package named sglang on PYTHONPATH: a stand-in where the check only asks whether the
    job's interpreter can import it (the real SGLang lives in .venv-sglang, not every machine has it)."""
    (tmp_path / "site" / "sglang").mkdir(parents=True)
    (tmp_path / "site" / "sglang" / "__init__.py").write_text("")
    return {"PYTHONPATH": str(tmp_path / "site")}


def test_sglang_must_be_importable_where_the_jobs_run_it_unless_conda_brings_it(tmp_path):
    config = kimi("sglang")
    config["model"]["path"] = str(model_dir(tmp_path / "model"))
    jobs = [Job("responses_sglang_server", "B1_glaive"), Job("hidden_states", "B1_glaive")]
    env = {"PATH": VENV_BIN}
    server, runner = problems(config, jobs, env, sglang_deployed=False)
    assert server.startswith(f"SGLang is not importable by {VENV_BIN}/python, which inference.sglang.launch runs")
    assert runner.startswith(f"SGLang is not importable by {sys.executable}, which runs torchrun")
    assert "--sdm conda" in server and "--sdm conda" in runner
    assert problems(config, jobs, env, sglang_deployed=True) == []
    assert problems(config, jobs, {**env, **fake_sglang(tmp_path)}, sglang_deployed=False) == []
    # a server the user runs (a URL, no launch) needs nothing here
    del config["inference"]["sglang"]["launch"]
    config["hidden_states"]["backend"] = "hf"
    assert problems(config, [Job("responses", "B1_glaive"), Job("hidden_states", "B1_glaive")], env, False) == []


def test_the_evaluate_jobs_need_specforges_interpreter_and_a_chain_of_proposals(tmp_path):
    from eagle3_datagen.workflow.settings import evaluate_problems

    config = fill_defaults(kimi("sglang"))
    config["model"]["path"] = str(model_dir(tmp_path / "model"))
    config["evaluate"] = fill_defaults({"python": str(tmp_path / "missing/bin/python")}, "evaluate")
    jobs = [Job("evaluate", "B1_glaive")]
    (problem,) = problems(config, jobs, {"PATH": VENV_BIN}, sglang_deployed=False)
    assert problem.startswith(f"evaluate.python {tmp_path}/missing/bin/python is not an interpreter here")
    assert "make specforge-env" in problem and "--sdm conda" in problem
    assert problems(config, jobs, {"PATH": VENV_BIN}, sglang_deployed=True) == []  # envs/specforge.yaml
    assert problems(config, [Job("tokens", "B1_glaive")], {"PATH": VENV_BIN}, sglang_deployed=False) == []
    config["evaluate"]["python"] = sys.executable
    assert problems(config, jobs, {"PATH": VENV_BIN}, sglang_deployed=False) == []
    # training on a GPU with this venv's CPU torch, or with envs/specforge.yaml's under --sdm conda
    config["evaluate"]["device"] = "cuda"
    (cpu_torch,) = problems(config, jobs, {"PATH": VENV_BIN}, sglang_deployed=False)
    assert cpu_torch.startswith(f"evaluate.device is cuda, and the torch of evaluate.python {sys.executable} is not")
    assert "set evaluate.device: cpu" in cpu_torch
    (conda,) = problems(config, jobs, {"PATH": VENV_BIN}, sglang_deployed=True)
    assert conda.startswith("evaluate.device is cuda, and --sdm conda runs the evaluate jobs in envs/specforge.yaml")
    config["evaluate"]["device"] = "cpu"
    assert evaluate_problems(config) == []
    config["evaluate"]["speculative"]["topk"] = 4
    (topk,) = evaluate_problems(config)
    assert topk.startswith("evaluate.speculative.topk is 4: the CPU evaluation decodes one chain")
    config["evaluate"]["speculative"].update(topk=1, num_draft_tokens=8)  # SGLang sets num_steps + 1 at topk 1
    assert evaluate_problems(config) == []
    config["evaluate"]["baseline"] = "original"
    assert evaluate_problems(config) == []


def test_hidden_states_larger_than_the_free_disk_stop_the_run(tmp_path):
    config = kimi("sglang")
    config["model"]["path"] = str(model_dir(tmp_path / "model"))
    config["hidden_states"]["backend"] = "hf"
    plan = tmp_path / "results" / "plan.json"
    plan.parent.mkdir()
    rows = [{"partition": "B1_glaive", "hidden_bytes": 2**70}, {"partition": "B3_magicoder_oss", "hidden_bytes": 1}]
    plan.write_text(json.dumps({"partitions": rows}))
    env = {"PATH": VENV_BIN}
    args = {"results": tmp_path / "results", "plan_file": plan}
    [found] = problems(config, [Job("hidden_states", "B1_glaive")], env, False, **args)
    assert re.match(r"the hidden states of B1_glaive need 1,099,511,627,776.0 GiB \(.*plan.json", found)
    assert "GiB are free under" in found
    assert problems(config, [Job("hidden_states", "B3_magicoder_oss")], env, False, **args) == []


@pytest.fixture(scope="module")
def kimi_workflow(tmp_path_factory) -> Path:
    """The workflow with the Kimi configs as shipped: their sources exist (empty), their model does not."""
    work = copy_workflow(tmp_path_factory.mktemp("preflight") / "wf")
    (work / "data/raw").mkdir(parents=True)
    for name in KIMI_SOURCES:
        (work / "data/raw" / name).write_text("")
    return work


def without_key(args: list[str], cwd: Path):
    """Snakemake, in an environment without the OpenRouter key."""
    saved = os.environ.pop("OPENROUTER_API_KEY", None)
    try:
        return run([str(Path(sys.executable).parent / "snakemake"), *args], cwd, check=False)
    finally:
        if saved is not None:
            os.environ["OPENROUTER_API_KEY"] = saved


def test_a_run_without_the_key_or_the_model_stops_before_any_job(kimi_workflow):
    proc = without_key(["--profile", "local", "--configfile", "config/kimi-k2.5-openrouter.yaml"], kimi_workflow)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "Preflight: this run would fail later; nothing has run." in out
    assert (
        "- $OPENROUTER_API_KEY is not set, and the responses of B1_glaive, B3_magicoder_evol, B3_magicoder_oss" in out
    )
    assert "- model.path /models/Kimi-K2.5 does not exist" in out
    assert not (kimi_workflow / "results").exists() and not (kimi_workflow / "logs").exists()


@pytest.mark.parametrize("name", ["openrouter", "sglang"])
def test_a_dry_run_warns_and_lists_both_trainers_exports(kimi_workflow, name):
    """The preview works on a laptop without the key or the model; the Kimi configs export for both trainers."""
    proc = without_key(["-n", "--profile", "local", "--configfile", f"config/kimi-k2.5-{name}.yaml"], kimi_workflow)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    warnings = [line for line in out.splitlines() if line.startswith("preflight: ")]
    assert "preflight: model.path /models/Kimi-K2.5 does not exist" in "\n".join(warnings)
    assert any("OPENROUTER_API_KEY" in line for line in warnings) == (name == "openrouter")
    assert re.search(r"^export\s+6$", proc.stdout, re.M)  # 3 partitions x (specforge, speculators)
    assert re.search(r"^vocab_mapping\s+1$", proc.stdout, re.M)


def test_a_template_that_writes_the_date_or_a_switch_it_never_reads_stops_the_run(tmp_path):
    """Read off the real templates' text (tests/fixtures/targets), before any job loads a tokenizer."""
    env = {"PATH": VENV_BIN, "OPENROUTER_API_KEY": "k"}
    jobs = [Job("tokens", "B1_glaive")]
    config = fill_defaults(kimi())
    config["hidden_states"]["backend"] = "hf"
    config["model"]["path"] = str(REPO / "tests/fixtures/targets/gpt-oss")
    [found] = problems(config, jobs, env, False)
    assert "writes today's date (strftime_now)" in found and "set model.chat_template_date" in found
    config["model"].update(chat_template_date="2025-06-28", chat_template_kwargs={"reasoning_effort": "high"})
    assert problems(config, jobs, env, False) == []
    config["model"].update(
        path=str(REPO / "tests/fixtures/targets/deepseek-v3"), chat_template_kwargs={"enable_thinking": False}
    )
    no_config, found = problems(config, jobs, env, False)  # (the fixture folder has no config.json)
    assert found.startswith("model.chat_template_kwargs sets ['enable_thinking'], which the chat template in")
    # a target the demo builds from a tokenizer folder: that folder's template
    family = fill_defaults(yaml.safe_load((REPO / "config/targets/gpt-oss.yaml").read_text()))
    family["evaluate"]["python"] = sys.executable
    assert problems(family, config_jobs(family), env, False) == []
    family["model"]["chat_template_date"] = None
    assert any("strftime_now" in line for line in problems(family, config_jobs(family), env, False))
