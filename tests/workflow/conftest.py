"""The workflow tier's fixture: the demo, run once a session."""

from pathlib import Path

import pytest

from tests.helpers import DEMO_CONSOLE, copy_workflow, leave_out_baseline, readme_commands, run


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
