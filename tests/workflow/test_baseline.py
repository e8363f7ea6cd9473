"""The baseline partitions (`evaluate.baseline: original`): each partition P's twin `P+original`, P's prompts
answered by the dataset's own turns through tokens, hidden states and the SpecForge export."""

from collections import Counter
from pathlib import Path

import jsonschema
import pytest
import yaml

from eagle3_datagen import config_schema
from eagle3_datagen.workflow import partitions as parts
from eagle3_datagen.workflow import placement
from eagle3_datagen.workflow import settings as wf
from tests.helpers import REPO, copy_workflow, scheduled, snakemake

DEMO = yaml.safe_load((REPO / "config.yaml").read_text())


def demo(baseline: str) -> dict:
    config = config_schema.fill_defaults(yaml.safe_load((REPO / "config.yaml").read_text()))
    config["evaluate"]["baseline"] = baseline
    return config


def test_each_partition_gets_a_twin_with_its_settings_and_the_dataset_backend():
    assert parts.baseline_partitions(demo("none")) == []
    config = demo("original")
    assert DEMO["evaluate"]["baseline"] == "original"  # the demo ships with it on
    assert parts.baseline_partitions(config) == [
        "demo_alpaca+original",
        "demo_openai+original",
        "demo_sharegpt+original",
    ]
    twin = parts.baseline_partition("demo_alpaca")
    assert twin == "demo_alpaca+original" and parts.prompt_partition(twin) == "demo_alpaca"
    assert parts.prompt_partition("demo_alpaca") == "demo_alpaca"
    assert parts.partition_config(config, twin) == {**config["partitions"]["demo_alpaca"], "backend": "dataset"}
    assert parts.shard_names(config, twin) == parts.shard_names(config, "demo_alpaca") == ["00000"]
    assert parts.inference_backend(config, twin) == "dataset" and placement.gpus_for(config, "responses", twin) == 0
    # nothing is sampled: only the records' source and layout, and the model (its think tokens), shape them
    assert wf.response_settings(config, twin) == {
        "backend": "dataset",
        "dataset": {
            "source": "resources/demo/data/alpaca.json",
            "format": "alpaca",
            "system_prompt": "You are a helpful assistant.",
        },
        "model": wf.model_settings(config),
    }
    with pytest.raises(KeyError, match="no partition 'demo_alpaca\\+original'"):
        parts.partition_config(demo("none"), twin)


def test_no_user_partition_can_take_a_twins_name():
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    config["partitions"]["chat+original"] = config["partitions"]["demo_alpaca"]
    with pytest.raises(jsonschema.ValidationError, match="chat\\+original"):
        jsonschema.validate(config, config_schema.schema())


def dry_run(work: Path, config: dict, targets: list[str]) -> Counter:
    (work / "baseline.yaml").write_text(yaml.safe_dump(config))
    out = snakemake([*targets, "-n", "--profile", "profiles/local", "--configfile", "baseline.yaml"], work).stdout
    return Counter(scheduled(out)), out


def twin_exports(config: dict) -> list[str]:
    return [f"results/{parts.baseline_partition(p)}/export/specforge" for p in sorted(config["partitions"])]


def test_the_demo_dry_run_lists_exactly_the_twins_jobs(tmp_path):
    """Baseline on: the evaluate jobs ask for the twins' exports; each twin adds its responses, tokens and
    hidden states per shard of its partition and one export, reading its partition's prompt shards: no
    prompts, probe, vocabulary or report job."""
    work = copy_workflow(tmp_path / "wf")
    without = {**DEMO, "evaluate": {**DEMO["evaluate"], "baseline": "none"}}
    off, _ = dry_run(work, without, [])
    both, out = dry_run(work, DEMO, [])
    extra = both - off
    assert sum((both & off).values()) == sum(off.values())  # every job of the demo is still there
    expected = Counter()
    for p, part in DEMO["partitions"].items():
        twin = parts.baseline_partition(p)
        expected.update({(rule, twin): part["shards"] for rule in ("responses", "tokens", "hidden_states")})
        expected[("export", twin)] = 1
    assert extra == expected
    assert "input: results/demo_sharegpt/prompts/00001.jsonl.zst, resources/demo/data/sharegpt.jsonl" in out
    # baseline off, no rule makes a twin's output
    (work / "off.yaml").write_text(yaml.safe_dump(without))
    proc = snakemake(
        [twin_exports(DEMO)[0], "-n", "--profile", "profiles/local", "--configfile", "off.yaml"], work, check=False
    )
    assert proc.returncode != 0 and "MissingRuleException" in proc.stdout + proc.stderr
