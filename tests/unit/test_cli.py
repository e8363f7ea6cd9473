"""The package's command-line helpers (eagle3_datagen/cli.py): Snakemake reads retried on a named race only."""

import subprocess

import pytest


def test_snakemake_reads_are_retried_only_for_the_named_failure(monkeypatch):
    from eagle3_datagen import cli

    race = "Unable to obtain modification time of file results/vocab: a concurrent process has deleted it"
    answers = [(1, "", race), (0, "summary", "")]
    calls = []

    def fake_run(command, **kwargs):
        calls.append(command)
        code, out, err = answers[len(calls) - 1]
        return subprocess.CompletedProcess(command, code, out, err)

    monkeypatch.setattr(cli.subprocess, "run", fake_run)
    monkeypatch.setattr(cli.time, "sleep", lambda s: None)
    assert cli.run_snakemake(["--summary"], retry_when="a concurrent process has deleted it") == "summary"
    assert len(calls) == 2
    calls.clear()
    answers[:] = [(1, "", "MissingInputException")]
    with pytest.raises(cli.SnakemakeFailed, match="MissingInputException"):
        cli.run_snakemake(["--summary"], retry_when="a concurrent process has deleted it")
    assert len(calls) == 1
