"""What a user sees on the console when something is wrong: a failed job's reason, a config error."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .conftest import REPO, copy_workflow, snakemake


@pytest.fixture(scope="module")
def workflow(tmp_path_factory) -> Path:
    return copy_workflow(tmp_path_factory.mktemp("console") / "wf")


def demo_config(work: Path, name: str, edit) -> str:
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    edit(config)
    (work / name).write_text(yaml.safe_dump(config))
    return name


def test_a_failed_jobs_reason_reaches_the_console(workflow):
    """The script's one-line error, not a traceback, is printed beside Snakemake's "Error in rule"."""
    (workflow / "bad.jsonl").write_text('{"conversations": [{"from": "human", "value": "hi"}]}\n[1, 2]\n')
    config = demo_config(
        workflow,
        "bad.yaml",
        lambda c: c.update(partitions={"bad": {"source": "bad.jsonl", "format": "sharegpt", "shards": 1}}),
    )
    proc = snakemake(["--profile", "local", "--configfile", config, "--until", "prompts_bad"], workflow, check=False)
    assert proc.returncode != 0
    reason = "error: bad.jsonl:2: expected a JSON object, got list. Fix: make each line one JSON object"
    assert reason in proc.stderr.splitlines()
    assert "Traceback" not in (workflow / "logs/bad/prompts.log").read_text()
    assert (workflow / "logs/bad/prompts.log").read_text().splitlines()[-1] == reason


def test_a_user_error_is_one_line_and_exit_2(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts/prompts.py"),
            "--source",
            str(tmp_path / "missing.jsonl"),
            "--out",
            str(tmp_path / "00000.jsonl.zst"),
            "--stats",
            str(tmp_path / "stats.json"),
            "--settings",
            '{"format": "sharegpt"}',
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1].startswith(f"error: {tmp_path / 'missing.jsonl'}: ")
    assert "Traceback" not in proc.stderr
