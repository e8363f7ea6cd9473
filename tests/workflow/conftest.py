"""The workflow tier's fixtures: the demo, run once a session; demo models, built once a session each."""

import base64
import shutil
from pathlib import Path

import pytest
import yaml

from eagle3_datagen.workflow import settings as wf
from tests.helpers import DEMO_CONSOLE, copy_workflow, leave_out_baseline, readme_commands, run, snakemake


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> Path:
    """The embedded demo, run once with the README's own command in a copy of the workflow, without the
    baseline the demo ships on (evaluate.baseline: its twins' jobs and trainings would double the evaluate
    jobs of every test that shares this run; tests/workflow/test_baseline_workflow.py turns it on in a copy)."""
    work = copy_workflow(tmp_path_factory.mktemp("demo") / "wf")
    leave_out_baseline(work / "config.yaml")
    demo_command = readme_commands()[0]
    proc = run(demo_command, work)
    (work / DEMO_CONSOLE).write_text(proc.stdout + proc.stderr)
    return work


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory):
    """`place(work, configfile)`: the demo model of a fresh copy of the workflow, as its run builds it, with
    Snakemake's record of the job (so the run finds it up to date). Each model (the demo section's settings
    and the partitions it is fitted to) is built once a session, by Snakemake in a copy of its own: the
    tests that run the same partitions from a fresh copy share its fit (a minute on a busy machine)."""
    built: dict[str, Path] = {}

    def place(work: Path, configfile: str) -> None:
        config = yaml.safe_load((work / configfile).read_text())
        model = config["model"]["path"]
        key = wf.as_json([wf.demo_settings(config), wf.demo_fit_partitions(config)])
        if key not in built:
            cache = copy_workflow(tmp_path_factory.mktemp("demo-model") / "wf")
            shutil.copy(work / configfile, cache / configfile)
            snakemake([model, "--profile", "profiles/local", "--configfile", configfile], cache)
            built[key] = cache
        shutil.copytree(built[key] / model, work / model)
        record = Path(".snakemake/metadata") / base64.urlsafe_b64encode(model.encode()).decode()
        (work / record.parent).mkdir(parents=True, exist_ok=True)
        shutil.copy2(built[key] / record, work / record)

    return place
