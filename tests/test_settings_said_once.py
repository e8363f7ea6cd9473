"""A setting said once, in the schema: every key described there, docs/settings.md's table generated from it,
and no default or "absent means" rule for a config key in the package's code."""

from pathlib import Path

from eagle3_datagen import config_schema
from eagle3_datagen.workflow.settings_doc import BEGIN, END, settings_table, with_table

ROOT = Path(__file__).resolve().parents[1]


def test_every_key_has_a_description():
    assert [key for key, node in config_schema.leaf_keys().items() if not node.get("description")] == []


def test_settings_page_holds_the_generated_table():
    page = (ROOT / "docs" / "settings.md").read_text()
    assert page == with_table(page), "docs/settings.md's table is stale: run python scripts/settings_table.py --write"
    table = page.split(BEGIN, 1)[1].split(END, 1)[0].strip().splitlines()
    assert len(table) == 2 + len(config_schema.leaf_keys())
    assert "| `evaluate.speculative.topk` | output | `1` |" in settings_table()


def test_stale_table_is_told_apart():
    page = (ROOT / "docs" / "settings.md").read_text()
    stale = page.replace("| `tokens.max_length` | output | `32768` |", "| `tokens.max_length` | output | `4096` |")
    assert stale != page and with_table(stale) == page
