"""What the repository ships: CI running the README's test command, configs that pass the schema, no default
profile (tests/test_scripts.py holds each script to its --help)."""

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


def test_no_default_profile_overrides_the_chosen_one():
    assert not (REPO / "profiles" / "default").exists()
