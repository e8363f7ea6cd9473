"""The workflow writes only under its own folders: no config, shipped or a user's, can make a rule's output
(which Snakemake deletes before the job that remakes it) a path the workflow did not create."""

import os
import re
from pathlib import Path

import pytest
import yaml

from eagle3_datagen.workflow.config_checks import demo_model_problems
from tests.helpers import REPO, copy_workflow, snakemake

OWN_FOLDERS = {"results", "logs", "benchmarks"}
SHIPPED_CONFIGS = [
    "config.yaml",
    "config/tiny-kimi.yaml",
    "config/kimi-k2.5-sglang.yaml",
    "config/kimi-k2.5-openrouter.yaml",
]


@pytest.fixture(scope="module")
def workflow_copy(tmp_path_factory) -> Path:
    work = copy_workflow(tmp_path_factory.mktemp("owned") / "wf")
    # The Kimi configs' sources: empty files stand in, since only the dry-run's job list is read.
    for config in SHIPPED_CONFIGS:
        for part in yaml.safe_load((REPO / config).read_text())["partitions"].values():
            source = work / part["source"]
            if not source.exists():
                source.parent.mkdir(parents=True, exist_ok=True)
                source.touch()
    return work


@pytest.fixture
def user_model(tmp_path) -> Path:
    """A user's own model directory, older than the data (downloaded before the checkout)."""
    model = tmp_path / "models" / "my-model"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"hidden_size": 64}')
    (model / "model.safetensors").write_bytes(b"weights")
    for f in model.iterdir():
        os.utime(f, (0, 0))
    os.utime(model, (0, 0))
    return model


def user_config(work: Path, model: Path, *, keep_demo: bool) -> Path:
    """A copy of config.yaml pointed at the user's own model, as a new user writes it."""
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    config["model"] = {"path": str(model)}
    if not keep_demo:
        del config["demo"]
    path = work / f"user-{keep_demo}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def planned_jobs(work: Path, configfile: str) -> dict[str, dict[str, list[str]]]:
    """Every rule of a forced dry-run, with the outputs, logs and benchmarks of its last job."""
    out = snakemake(["-n", "--forceall", "--profile", "profiles/local", "--configfile", configfile], work).stdout
    jobs = {}
    for block in re.split(r"^(?:local)?rule ", out, flags=re.M)[1:]:
        fields = re.findall(r"^\s+(output|log|benchmark): (.+)$", block, re.M)
        jobs[block.split(":", 1)[0]] = {name: value.split(", ") for name, value in fields}
    assert jobs, out[-2000:]
    return jobs


@pytest.mark.parametrize("configfile", [*SHIPPED_CONFIGS, "user"])
def test_every_output_lies_under_the_workflow_folders(workflow_copy, user_model, configfile):
    if configfile == "user":
        configfile = str(user_config(workflow_copy, user_model, keep_demo=False))
    jobs = planned_jobs(workflow_copy, configfile)
    paths = [path for fields in jobs.values() for paths in fields.values() for path in paths]
    outside = [p for p in paths if Path(p).is_absolute() or Path(p).parts[0] not in OWN_FOLDERS]
    assert outside == []
    assert str(user_model) not in paths
    # Every rule that touches data keeps a log and a benchmark (`all` only collects the targets).
    unrecorded = [rule for rule, fields in jobs.items() if rule != "all" and not {"log", "benchmark"} <= set(fields)]
    assert unrecorded == []


def test_a_demo_config_pointed_at_a_user_model_is_refused_and_the_model_survives(workflow_copy, user_model):
    before = {f.name: f.read_bytes() for f in user_model.iterdir()}
    configfile = user_config(workflow_copy, user_model, keep_demo=True)
    proc = snakemake(["--profile", "profiles/local", "--configfile", str(configfile)], workflow_copy, check=False)
    assert proc.returncode != 0
    message = proc.stdout + proc.stderr
    assert f"model.path {str(user_model)!r} with a demo: block" in message
    assert "delete the demo: block from your config" in message
    assert {f.name: f.read_bytes() for f in user_model.iterdir()} == before
    assert not (workflow_copy / "results").exists()


@pytest.mark.parametrize(
    ("path", "refused"),
    [
        ("results/demo/model", False),
        ("results/tiny-kimi/model", False),
        ("/models/Kimi-K2.5", True),
        ("models/mine", True),
        ("results", True),
        ("results/../models/mine", True),
    ],
)
def test_the_demo_model_lies_under_results(path, refused):
    problems = demo_model_problems({"demo": {}, "model": {"path": path}})
    assert bool(problems) == refused
    assert demo_model_problems({"model": {"path": path}}) == []
