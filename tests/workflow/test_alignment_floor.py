"""The probe's hard floor through the workflow, on sampled data (temperature 1): a shard whose final slot holds
other states than its index.json says fails its probe job, and its partition's exports and the release of its
shards do not run; the good shard beside it passes. A fresh copy of the workflow, one partition of 4 prompts."""

import json

import pytest
import yaml

from tests.helpers import copy_workflow, defaults, snakemake

pytestmark = pytest.mark.e2e

PARTITION, GOOD, DEFECTIVE = "demo_sharegpt", "00000", "00001"


def test_a_sampled_shard_below_the_floor_fails_its_probe_and_stops_the_exports(tmp_path):
    work = copy_workflow(tmp_path / "wf")
    config = yaml.safe_load((work / "config.yaml").read_text())
    config["partitions"] = {PARTITION: {**config["partitions"][PARTITION], "max_prompts": 4}}
    # the demo's 48 new tokens: its sampled answers end before them (27 at most), none is gated as cut off
    config["inference"]["sampling"]["temperature"] = 1.0
    config["hidden_states"]["keep_shards"] = False  # the exports would be the one copy: the release waits
    del config["evaluate"]
    (work / "sampled.yaml").write_text(yaml.safe_dump(config))
    args = ["--profile", "profiles/local", "--configfile", "sampled.yaml"]
    shards = {s: work / f"results/{PARTITION}/hidden/{s}" for s in (GOOD, DEFECTIVE)}
    snakemake([*(f"results/{PARTITION}/hidden/{s}" for s in shards), *args], work)
    # The demo stores the final layer raw; index.json of one shard now says normed, as a capture that stores
    # the raw layer where the config asks for the norm's output would write it.
    index = json.loads((shards[DEFECTIVE] / "index.json").read_text())
    assert index["final"] == "raw"
    (shards[DEFECTIVE] / "index.json").write_text(json.dumps({**index, "final": "normed"}))
    parts = sorted(p.name for p in shards[DEFECTIVE].iterdir())

    exports = [f"results/{PARTITION}/export/{f}" for f in config["export"]["formats"]]
    released = f"results/{PARTITION}/hidden/released.json"
    proc = snakemake([*exports, released, *args, "--keep-going"], work, check=False)
    assert proc.returncode != 0
    good = json.loads((work / f"results/{PARTITION}/probe/{GOOD}.json").read_text())
    assert good["greedy_exact"] is False and good["verdict"] in ("ok", "warn")
    assert good["alignment"]["aligned_best_share"] >= defaults("probe")["min_aligned_best_share"]
    assert good["final_norm"]["holds"] == "raw"
    assert not (work / f"results/{PARTITION}/probe/{DEFECTIVE}.json").exists()
    log = (work / f"logs/{PARTITION}/probe/{DEFECTIVE}.log").read_text()
    assert "index.json says the final slot is normed, but 0.0% of the probed rows" in log
    assert "the slot holds raw states" in log
    for path in (*exports, released):
        assert not (work / path).exists(), path
    assert sorted(p.name for p in shards[DEFECTIVE].iterdir()) == parts  # nothing released
    assert not any("rule export" in line or "rule release_hidden" in line for line in proc.stderr.splitlines())
