"""Released states are captured once (hidden_states.keep_shards: false): in a finished run whose shards were
released, an export's settings, the probe's thresholds, the vocabulary's size and a code update of the export
rule rerun what they change from the kept copy and capture nothing; a change to what shapes the states is
refused before any job, with the price of capturing again. A fresh copy of the workflow, one partition of 4
prompts in 2 shards; its demo model the session's fit to that partition (tests/workflow/conftest.py)."""

import gzip
import json
import shutil
import time
from pathlib import Path

import pytest
import yaml

from eagle3_datagen.formats.released import finished_copy
from tests.helpers import copy_workflow, scheduled, snakemake

pytestmark = pytest.mark.e2e

PARTITION = "demo_sharegpt"


def _captures(proc) -> int:
    """Capture jobs a Snakemake run ran."""
    return proc.stderr.count("rule hidden_states:")


def test_a_released_partition_reruns_what_changed_from_the_kept_copy_and_never_captures(tmp_path, demo_model):
    work = copy_workflow(tmp_path / "wf")
    config = yaml.safe_load((work / "config.yaml").read_text())
    config["partitions"] = {PARTITION: {**config["partitions"][PARTITION], "max_prompts": 4}}
    config["hidden_states"]["keep_shards"] = False
    del config["evaluate"]
    (work / "once.yaml").write_text(yaml.safe_dump(config))
    demo_model(work, "once.yaml")
    args = ["--profile", "profiles/local", "--configfile", "once.yaml"]
    exports = [f"results/{PARTITION}/export/{f}" for f in config["export"]["formats"]]
    targets = [*exports, f"results/{PARTITION}/hidden/released.json", "results/vocab"]
    shards = [f"results/{PARTITION}/hidden/{s}" for s in ("00000", "00001")]
    assert _captures(snakemake([*shards, *args], work)) == 2
    finished = (work / shards[0] / "index.json").read_text()
    # a retried group job (its jobs run with --force) whose attempt had finished shard 00000 and not 00001
    shutil.rmtree(work / shards[1])
    shutil.rmtree(finished_copy(work / shards[1]))
    started = time.monotonic()
    retried = snakemake([*shards, *args, "--force"], work)
    retry_seconds = time.monotonic() - started
    assert _captures(retried) == 2  # both jobs run; the finished one is linked back
    assert (work / shards[0] / "index.json").read_text() == finished  # its own throughput record: not recomputed
    assert "nothing captured" in (work / f"logs/{PARTITION}/hidden/00000.log").read_text()
    assert "nothing captured" not in (work / f"logs/{PARTITION}/hidden/00001.log").read_text()
    print(f"retried group: 1 of 2 shards captured again, {retry_seconds:.1f} s")

    assert _captures(snakemake([*targets, *args], work)) == 0
    hidden = work / f"results/{PARTITION}/hidden"
    assert not list(hidden.glob("0*/part-*")), "the parts were released"
    before = {Path(e).name: json.loads((work / e / "export.json").read_text()) for e in exports}
    rows = sorted((work / exports[0]).glob("rows_*/*.ckpt"))
    plain = {p.name: p.read_bytes() for p in rows}
    probe_before = json.loads((work / f"results/{PARTITION}/probe/00000.json").read_text())

    # every change below capture at once: SpecForge's rows gzipped, a probe threshold, the draft vocabulary's
    # size, and a code update of the export rule (its shell command), which Snakemake's code trigger sees
    config["export"]["specforge"] = {"compress": "gzip"}
    config["probe"] = {"min_greedy_agreement": 0.5}  # the demo's greedy data with exact output IDs
    config["vocab_mapping"]["draft_vocab_size"] = 128
    (work / "once.yaml").write_text(yaml.safe_dump(config))
    rule = work / "rules/export.smk"
    rule.write_text(rule.read_text().replace('"python scripts/export.py', '"EXPORT_CODE=2 python scripts/export.py'))

    dry = snakemake([*targets, *args, "-n", "--verbose"], work)
    jobs = [r for r, _ in scheduled(dry.stdout)]
    assert "hidden_states" not in jobs
    assert sorted(jobs).count("export") == 2 and jobs.count("probe") == 2 and "vocab_mapping" in jobs
    started = time.monotonic()
    run = snakemake([*targets, *args], work)
    seconds = time.monotonic() - started
    assert _captures(run) == 0, "nothing captured again"
    gz = sorted((work / exports[0]).glob("rows_*/*.ckpt.gz"))
    assert {p.name.removesuffix(".gz"): gzip.decompress(p.read_bytes()) for p in gz} == plain
    after = json.loads((work / exports[0] / "export.json").read_text())
    assert after["rows"]["compress"] == "gzip" and after["samples"] == before["specforge"]["samples"]
    assert json.loads((work / exports[0] / "draft_config.json").read_text())["draft_vocab_size"] == 128
    speculators = json.loads((work / exports[1] / "export.json").read_text())
    readme = {"README.md": speculators["files"]["README.md"]}
    assert speculators["files"] == {**before["speculators"]["files"], **readme}  # the states' files linked
    probe = json.loads((work / f"results/{PARTITION}/probe/00000.json").read_text())
    assert probe == probe_before and probe["greedy_exact"] is True and probe["verdict"] == "ok"  # the same numbers
    log = (work / f"logs/{PARTITION}/probe/00000.log").read_text()
    assert "judged again from the measurements recorded in" in log
    kept = hidden / "kept/specforge"
    assert sorted(p.name for p in kept.glob("rows_*/*")) == sorted(p.name for p in gz)
    print(f"rerun below capture: {len(jobs)} jobs, {after['bytes']} bytes of SpecForge export, {seconds:.1f} s")

    # what shapes the states: refused before any job, with its price
    config["hidden_states"]["compress_level"] = 9
    (work / "once.yaml").write_text(yaml.safe_dump(config))
    logs = sorted(p for p in (work / "logs").rglob("*.log"))
    refused = snakemake([*targets, *args], work, check=False)
    assert refused.returncode != 0
    assert "Capturing the 2 released shards" in refused.stderr and "node-hours" in refused.stderr
    assert sorted(p for p in (work / "logs").rglob("*.log")) == logs and _captures(refused) == 0
