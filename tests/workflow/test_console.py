"""What a user sees on the console when something is wrong: a failed job's reason, a config error."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO, copy_workflow, snakemake


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
    reason = (
        "error: bad.jsonl:2: expected a JSON object, got list; 1 of 2 records could not be read (allowed: 0.00%)."
        " Fix: make each line one JSON object, or raise the partition's max_bad_record_rate to drop them"
    )
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


def test_a_misspelled_key_is_named_in_a_few_lines_with_the_nearest_key(workflow):
    """Snakemake's own message for this config is 1,310 lines (the schema, whole)."""
    config = demo_config(workflow, "typo.yaml", lambda c: c.update(partitons=c.pop("partitions")))
    proc = snakemake(["-n", "--configfile", config], workflow, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and len(out.splitlines()) < 40
    assert "- the top level: 'partitons' was unexpected: did you mean 'partitions'? Allowed: demo, evaluate," in out
    assert "- the top level: 'partitions' is a required property" in out
    assert "rule " not in proc.stdout


def test_a_wrong_value_names_its_key_and_what_is_allowed_but_never_echoes_a_secret(workflow):
    def edit(config):
        config["partitions"]["demo_alpaca"]["format"] = "vicuna"
        config["inference"]["openrouter"] = {"model": "m", "api_key_env": "sk-or-v1-secret"}

    proc = snakemake(["-n", "--configfile", demo_config(workflow, "values.yaml", edit)], workflow, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and len(out.splitlines()) < 40
    assert "- partitions.demo_alpaca.format: 'vicuna' is not one of ['sharegpt'," in out
    assert "- inference.openrouter.api_key_env: the value given does not match '^[A-Z_][A-Z0-9_]*$'" in out
    assert "sk-or-v1-secret" not in out
