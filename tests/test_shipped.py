"""What the repository ships: CI running the README's test command, configs that pass the schema, scripts that answer
--help, no default profile."""

import subprocess
import sys

import pytest
import yaml
from snakemake.utils import validate

from .conftest import REPO, readme_commands

SCHEMA = REPO / "schemas" / "config.schema.yaml"


def test_ci_runs_the_readmes_test_command():
    """tests/test_readme.py holds the README to its two commands; CI runs the second."""
    assert readme_commands()[1] in (REPO / ".ci" / "run").read_text().splitlines()


@pytest.mark.parametrize(
    "name", ["config.yaml", "config/kimi-k2.5-sglang.yaml", "config/kimi-k2.5-openrouter.yaml", "config/tiny-kimi.yaml"]
)
def test_shipped_configs_pass_the_schema(name):
    validate(yaml.safe_load((REPO / name).read_text()), schema=str(SCHEMA))


HELP_EACH_SCRIPT = """
import contextlib, io, runpy, sys
for path in sys.argv[1:]:
    sys.argv, out = [path, "--help"], io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(path, run_name="__main__")
            code = "no exit"
        except SystemExit as done:
            code = done.code
    print(path, code, out.getvalue().startswith("usage:"))
"""


def test_scripts_are_thin_entry_points_with_help():
    """Every script answers --help with its usage and exits 0; all in one process, so that torch and
    transformers are imported once, not once per script."""
    scripts = sorted(str(p) for p in (REPO / "scripts").glob("*.py"))
    proc = subprocess.run([sys.executable, "-c", HELP_EACH_SCRIPT, *scripts], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    answers = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()}
    assert answers == {path: ["0", "True"] for path in scripts}


def test_no_default_profile_overrides_the_chosen_one():
    assert not (REPO / "profiles" / "default").exists()
