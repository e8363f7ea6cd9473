"""The workflow's config schema (`config.schema.yaml`, shipped in the package): the one place each setting is said, with
its `default`, its `description` and its kind (`x-kind`: `output` shapes a stage's output, `run` governs
only how its jobs run). The rest of the package reads defaults and kinds from here, never its own copy.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import yaml

# The Snakefile validates with this file too, so the package and the workflow read one schema.
SCHEMA_PATH = Path(__file__).resolve().with_name("config.schema.yaml")
KIND = "x-kind"


@functools.cache
def schema() -> dict:
    return yaml.safe_load(SCHEMA_PATH.read_text())


def _resolved(node: dict) -> dict:
    if "$ref" in node:
        return schema()["$defs"][node["$ref"].rsplit("/", 1)[1]]
    return node


def leaf_keys(node: dict | None = None, path: str = "") -> dict[str, dict]:
    """Every setting of the schema by dotted path (`*` for a partition's name), with its schema.

    An object is descended into when its keys are closed (additionalProperties false, or named by an
    enum); an open object (template kwargs, provider routing, server flags) is one setting.
    """
    node = _resolved(schema() if node is None else node)
    props = node.get("properties")
    closed = node.get("additionalProperties") is False or "enum" in node.get("propertyNames", {})
    if props and closed:
        keys = {}
        for name, sub in props.items():
            keys |= leaf_keys(sub, f"{path}.{name}" if path else name)
        return keys
    extra = node.get("additionalProperties")
    if isinstance(extra, dict) and extra.get("properties"):
        return leaf_keys(extra, f"{path}.*")
    return {path: node}


def kinds() -> dict[str, str]:
    """Each setting's `x-kind`, by dotted path; a setting without one is left out (and fails the tests)."""
    return {path: node[KIND] for path, node in leaf_keys().items() if KIND in node}


OUTPUT = "output"  # shapes the stage's output: in the rule's params, so a change reruns the stage
RUN = "run"  # governs only how the job runs: read at run time, a change reschedules nothing

# Every config key's kind, by its path in the schema (`*`: any partition's name): each key's `x-kind`
# in config.schema.yaml, where a key without one fails tests/unit/test_settings.py.
KINDS: dict[str, str] = kinds()


def kind_of(path: str) -> str:
    """The kind of the config key at dotted `path` (a partition's name in place of `*`)."""
    parts = path.split(".")
    if parts[0] == "partitions" and len(parts) > 2:
        parts[1] = "*"
    key = ".".join(parts)
    if key not in KINDS:
        raise KeyError(f"config key {key!r} has no x-kind in config.schema.yaml")
    return KINDS[key]


def split(section: dict | None, path: str) -> tuple[dict, dict]:
    """`section` (the config at dotted `path`) as its output-shaping and its run-only settings."""
    output, run = {}, {}
    for key, value in (section or {}).items():
        sub = f"{path}.{key}"
        if isinstance(value, dict) and not _is_leaf(sub):
            out_part, run_part = split(value, sub)
            if out_part:
                output[key] = out_part
            if run_part:
                run[key] = run_part
        elif kind_of(sub) == OUTPUT:
            output[key] = value
        else:
            run[key] = value
    return output, run


def _is_leaf(path: str) -> bool:
    try:
        kind_of(path)
    except KeyError:
        return False
    return True


def fill_defaults(instance: dict, path: str = "") -> dict:
    """`instance` (the config, or its section at dotted `path`) with every absent key that has a schema
    `default` set to a copy of it, in place, in every object the instance has or gains: partitions and
    objects whose own default (`{}`) fills them included. Snakemake's `validate` fills the same keys but
    one: a default behind a `$ref` (both backends' `retry`), which it does not look through."""
    node = schema()
    for name in filter(None, path.split(".")):
        node = _resolved(node)
        node = node["additionalProperties"] if name == "*" else node["properties"][name]
    _fill(instance, node)
    return instance


def _fill(instance, node: dict) -> None:
    node = _resolved(node)
    if not isinstance(instance, dict):
        return  # validation says what is wrong with it
    props = node.get("properties", {})
    for name, sub in props.items():
        sub = _resolved(sub)
        if name not in instance and "default" in sub:
            instance[name] = copy.deepcopy(sub["default"])
        if name in instance:
            _fill(instance[name], sub)
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        for name, value in instance.items():
            if name not in props:
                _fill(value, extra)
