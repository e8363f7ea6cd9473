"""A setting said once, in the schema: every key described there, docs/settings.md's table generated from it,
and no default or "absent means" rule for a config key in the package's code."""

import ast
from pathlib import Path

from eagle3_datagen import config_schema
from eagle3_datagen.workflow.settings_doc import BEGIN, END, settings_table, with_table

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "eagle3_datagen"
# The names the package gives a config section it reads; a `.get` on anything else (a message, an index.json,
# a job's resources) reads data, whose keys may share a setting's name.
CONFIG_NAMES = {"config", "settings", "configured", "launch", "section", "part", "inference", "sampling", "tier"}
# "Absent means" rules no schema default can say, each in one function: (module, key): why.
ABSENT_MEANS = {
    ("backends/plugins.py", "command"): "the job's own interpreter: a default would name one machine's",
    ("backends/service/__init__.py", "args"): "no flags: a default would change the params of every config without it",
    ("chat/template.py", "expected_ids"): "no pins: a default would change the tokens params of every config",
}


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


def _literal(node: ast.expr) -> bool:
    return isinstance(node, (ast.List, ast.Dict, ast.Tuple, ast.Set)) or (
        isinstance(node, ast.Constant) and node.value is not None
    )


def _reads_config(receiver: ast.expr) -> bool:
    while isinstance(receiver, (ast.Subscript, ast.Attribute, ast.Call)):
        receiver = receiver.func if isinstance(receiver, ast.Call) else receiver.value
    return isinstance(receiver, ast.Name) and receiver.id in CONFIG_NAMES


def _setting_get(node: ast.expr, keys: set[str]) -> str | None:
    """The setting `node` reads when it is `<config section>.get("key", ...)`."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
        key = node.args[0]
        if isinstance(key, ast.Constant) and key.value in keys and _reads_config(node.func.value):
            return key.value
    return None


def defaults_in_code(source: str, keys: set[str]) -> list[tuple[int, str]]:
    """`section.get("key", <literal>)` and `section.get("key") or <literal>` on a config section: each a default
    (or an "absent means" rule) said in code rather than in the schema, by line and key."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and len(node.args) > 1 and _literal(node.args[1]):
            key = _setting_get(node, keys)
        elif isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and _literal(node.values[-1]):
            key = _setting_get(node.values[0], keys)
        else:
            continue
        if key:
            found.append((node.lineno, key))
    return found


def test_no_default_outside_the_schema():
    keys = {path.rsplit(".", 1)[-1] for path in config_schema.leaf_keys()}
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, key in defaults_in_code(path.read_text(), keys):
            found.setdefault((path.relative_to(PACKAGE).as_posix(), key), []).append(line)
    said_in_code = {where: lines for where, lines in found.items() if where not in ABSENT_MEANS}
    assert said_in_code == {}, "put these defaults in src/eagle3_datagen/config.schema.yaml (module, key: lines)"
    assert {where: len(lines) for where, lines in found.items()} == dict.fromkeys(ABSENT_MEANS, 1)


def test_a_planted_default_is_found():
    keys = {"max_length", "args"}
    source = """
def f(config, settings, message):
    a = config["tokens"].get("max_length", 4096)
    b = settings.get("args") or []
    c = message.get("max_length", 0)  # data, not a setting
    d = settings.get("max_length")  # absent: None, no rule
"""
    assert defaults_in_code(source, keys) == [(3, "max_length"), (4, "args")]
