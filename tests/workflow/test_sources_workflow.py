"""Sources through the workflow: Snakemake on a copy reads a hub dataset from the local cache, reruns its
prompts for a new commit only, and fails an empty partition unless it may be empty."""

import json
import shutil

import pytest
import yaml

from eagle3_datagen.formats.files import read_jsonl
from eagle3_datagen.reporting.plan import scheduled_jobs
from tests.helpers import copy_workflow, snakemake
from tests.helpers.records import ALPACA, REALDATA, SHAREGPT, as_dataset, hub_cache, hub_layout

pytestmark = pytest.mark.e2e


def test_the_workflow_reads_a_hub_dataset_reruns_it_for_a_new_commit_only_and_fails_an_empty_partition(
    tmp_path, monkeypatch
):
    """Snakemake on a copy of the workflow: prompts from a hub dataset in the cache equal those of its
    JSONL; a new commit under `main` reschedules that partition's prompts and no other's; an empty source
    fails its job with the reason on the console, and passes with `allow_empty: true`."""
    work = copy_workflow(tmp_path / "wf")
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    first = hub_cache(cache, "owner/chats", hub_layout(tmp_path / "v1", [ALPACA], tmp_path / "ds-cache"))
    (work / "data").mkdir()
    shutil.copy(REALDATA / ALPACA, work / "data" / ALPACA)
    (work / "data" / "empty.jsonl").write_text("")
    config = yaml.safe_load((work / "config.yaml").read_text())
    config["partitions"] = {
        "hub": {"source": "hf:owner/chats", "split": "train", "format": "alpaca", "shards": 2},
        "local": {"source": f"data/{ALPACA}", "format": "alpaca", "shards": 2},
        "saved": {"source": "data/saved", "format": "alpaca", "shards": 2},
    }
    as_dataset(ALPACA, tmp_path / "ds-cache").save_to_disk(work / "data" / "saved")
    (work / "c.yaml").write_text(yaml.safe_dump(config))
    targets = [f"results/{p}/prompts/stats.json" for p in ("hub", "local", "saved")]
    snakemake([*targets, "-c1", "--configfile", "c.yaml"], work)
    hub, local, saved = (json.loads((work / t).read_text()) for t in targets)
    assert hub["commit"] == first and hub["prompts"] == local["prompts"] == saved["prompts"] == 40
    ids = {
        p: sorted(q["id"] for s in ("00000", "00001") for q in read_jsonl(work / f"results/{p}/prompts/{s}.jsonl.zst"))
        for p in ("hub", "local", "saved")
    }
    assert ids["hub"] == ids["local"] == ids["saved"]

    second = hub_cache(cache, "owner/chats", hub_layout(tmp_path / "v2", [SHAREGPT, ALPACA], tmp_path / "ds-cache"))
    assert second != first
    dry = snakemake([*targets, "-n", "--configfile", "c.yaml"], work).stdout
    assert [job.rule for job in scheduled_jobs(dry)] == ["prompts_hub"], dry

    config["partitions"] = {"empty": {"source": "data/empty.jsonl", "format": "sharegpt", "shards": 1}}
    (work / "c.yaml").write_text(yaml.safe_dump(config))
    failed = snakemake(["results/empty/prompts/stats.json", "-c1", "--configfile", "c.yaml"], work, check=False)
    assert failed.returncode != 0
    reason = "data/empty.jsonl: no prompts: data/empty.jsonl holds no record"
    assert reason in (work / "logs/empty/prompts.log").read_text()
    assert reason in failed.stdout + failed.stderr
    config["partitions"]["empty"]["allow_empty"] = True
    (work / "c.yaml").write_text(yaml.safe_dump(config))
    snakemake(["results/empty/prompts/stats.json", "-c1", "--configfile", "c.yaml"], work)
    assert json.loads((work / "results/empty/prompts/stats.json").read_text())["prompts"] == 0
