"""docs/settings.md's key table, generated from the config schema so that the page cannot drift from it:
each setting's dotted key (`*` for a partition's name), kind, default and description."""

from __future__ import annotations

import json

from eagle3_datagen import config_schema

BEGIN = "<!-- settings table: generated from the schema by `python scripts/settings_table.py --write` -->"
END = "<!-- end of the settings table -->"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _default(node: dict) -> str:
    return f"`{json.dumps(node['default'])}`" if "default" in node else ""


def settings_table() -> str:
    """The markdown table of every setting, in the schema's order."""
    rows = ["| key | kind | default | description |", "| --- | --- | --- | --- |"]
    for key, node in config_schema.leaf_keys().items():
        kind = node.get(config_schema.KIND, "")
        rows.append(f"| `{key}` | {kind} | {_cell(_default(node))} | {_cell(node.get('description', ''))} |")
    return "\n".join(rows)


def with_table(page: str, name: str = "docs/settings.md") -> str:
    """`page` (the text of `name`) with the generated table between its BEGIN and END markers."""
    if BEGIN not in page or END not in page:
        raise ValueError(f"{name} has no settings table markers: put {BEGIN} and {END} on lines of their own")
    head, rest = page.split(BEGIN, 1)
    return f"{head}{BEGIN}\n{settings_table()}\n{END}{rest.split(END, 1)[1]}"
