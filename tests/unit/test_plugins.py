"""The plug-in registries (generation and capture backends, trainer exports, dataset layouts) are what the
schema accepts, each entry's settings section is the schema's, and its declared needs are what the
workflow's settings derive from it."""

import copy

import pytest
import yaml

from eagle3_datagen import config_schema
from eagle3_datagen.backends.plugins import (
    CAPTURE,
    GENERATION,
    RESPONSE_RULE,
    SERVED_RESPONSE_RULE,
)
from eagle3_datagen.formats.datasets import LAYOUTS
from eagle3_datagen.formats.trainer_exports import EXPORTS
from eagle3_datagen.registry import import_implementation
from eagle3_datagen.workflow import config_checks, placement
from eagle3_datagen.workflow import partitions as parts
from eagle3_datagen.workflow import settings as wf
from tests.helpers import REPO

KEYS = config_schema.leaf_keys()


def enum(path: str) -> list[str]:
    node = KEYS[path]
    return node["items"]["enum"] if "items" in node else node["enum"]


@pytest.mark.parametrize(
    ("path", "registry", "extra"),
    [
        ("inference.backend", GENERATION, []),
        ("partitions.*.backend", GENERATION, []),
        ("hidden_states.backend", CAPTURE, []),
        ("export.formats", EXPORTS, []),
        ("partitions.*.format", LAYOUTS, ["auto"]),
    ],
)
def test_every_schema_enum_is_its_registry(path, registry, extra):
    assert sorted(enum(path)) == sorted([*registry, *extra])


def test_each_backend_and_export_has_its_schema_section():
    sections = {".".join(key.split(".")[:2]) for key in KEYS}
    for entry in [*GENERATION.values(), *CAPTURE.values()]:
        if entry.section is not None:
            assert entry.section == f"{entry.section.split('.')[0]}.{entry.name}"
            assert entry.section in sections, entry
    # an export's own settings, where it has any, are `export.<name>`
    assert {key.split(".")[1] for key in KEYS if key.startswith("export.")} - {"formats"} <= set(EXPORTS)


def test_each_entry_names_an_implementation_that_exists():
    """The classes and functions the entries name, imported as a job imports them (the SGLang capture
    imports SGLang, which runs in its own venv: tests/real_sglang loads it)."""
    for entry in GENERATION.values():
        if entry.implementation is not None:
            assert callable(import_implementation(entry.implementation)), entry
    assert callable(import_implementation(CAPTURE["hf"].implementation))
    for export in EXPORTS.values():
        assert export.exporter().__init__.__code__.co_varnames[1:6] == (
            "shards",
            "model_path",
            "vocab_dir",
            "draft_vocab_size",
            "settings",
        )


def demo_config() -> dict:
    return config_schema.fill_defaults(yaml.safe_load((REPO / "config.yaml").read_text()))


def test_the_workflow_reads_each_backends_needs_from_its_entry():
    config = demo_config()
    partition = sorted(config["partitions"])[0]
    for name, entry in GENERATION.items():
        changed = copy.deepcopy(config)
        changed["partitions"][partition]["backend"] = name
        changed["inference"].setdefault("sglang", {})["launch"] = config_schema.fill_defaults(
            {}, "inference.sglang.launch"
        )
        changed["inference"]["sglang"].setdefault("url", "http://127.0.0.1:30000")
        gpus = config["resources"]["gpus_per_node"] if entry.uses_gpu(changed) else 0
        assert placement.gpus_for(changed, "responses", partition) == gpus
        assert parts.served_by_launched_server(changed, partition) == (name == "sglang")
        assert entry.rule(changed) == (SERVED_RESPONSE_RULE if name == "sglang" else RESPONSE_RULE)
        assert wf.probe_settings(changed, partition)["backend"] == name
    hf = copy.deepcopy(config)
    hf["inference"]["hf"]["device"] = "cuda"
    assert GENERATION["hf"].uses_gpu(hf) and not GENERATION["hf"].uses_gpu(config)
    assert not GENERATION["openrouter"].uses_gpu(config) and GENERATION["sglang"].uses_gpu(config)
    assert CAPTURE["sglang"].ranks(config) == config["resources"]["gpus_per_node"] and CAPTURE["hf"].ranks(config) == 1


def test_the_workflow_reads_each_exports_needs_from_its_entry():
    """The export job's rate follows its entry's own compression setting, and the config check refuses a
    `hidden_states.final` that an export's trainer cannot take, before any job, naming the entry's reason."""
    config = demo_config()
    config["export"]["formats"] = EXPORTS.names()
    assert config_checks.storage_problems(config) == []
    gzipped = copy.deepcopy(config)
    gzipped["export"]["specforge"]["compress"] = "gzip"
    assert EXPORTS["specforge"].rate(gzipped) < EXPORTS["specforge"].rate(config)
    assert EXPORTS["speculators"].rate(gzipped) == EXPORTS["speculators"].rate(config)
    normed = copy.deepcopy(config)
    normed["hidden_states"]["final"] = "normed"
    refused = [name for name, export in EXPORTS.items() if "normed" not in export.finals]
    assert refused == ["speculators"]
    assert config_checks.storage_problems(normed) == [
        "hidden_states.final: normed cannot be exported to speculators: speculators 0.9.0 applies the verifier's "
        "final norm to the last slot itself and would norm it twice. Set hidden_states.final: raw (the other "
        "exports apply the final norm where their trainer needs it), or drop speculators from export.formats."
    ]


def test_an_unknown_name_lists_the_registered_ones():
    assert "no-such-engine" not in GENERATION and len(GENERATION) >= 2
    registered = "registered: " + ", ".join(GENERATION.names())
    with pytest.raises(KeyError, match=f"unknown generation backend 'no-such-engine'; {registered}$"):
        GENERATION["no-such-engine"]
