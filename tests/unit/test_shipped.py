"""What the repository ships: CI running the README's test command, configs that pass the schema, no default
profile (tests/unit/test_scripts.py holds each script to its --help)."""

import pytest
import yaml
from snakemake.utils import validate

from eagle3_datagen import config_schema
from tests.helpers import REPO, readme_commands

SCHEMA = config_schema.SCHEMA_PATH


def test_ci_runs_the_readmes_test_command():
    """tests/unit/test_readme.py holds the README to its two commands; CI runs the second."""
    assert readme_commands()[1] in (REPO / ".ci" / "run").read_text().splitlines()


TARGET_CONFIGS = sorted(str(p.relative_to(REPO)) for p in (REPO / "config" / "targets").glob("*.yaml"))


@pytest.mark.parametrize(
    "name",
    ["config.yaml", "config/kimi-k2.5-sglang.yaml", "config/kimi-k2.5-openrouter.yaml", "config/tiny-kimi.yaml"]
    + TARGET_CONFIGS,
)
def test_shipped_configs_pass_the_schema(name):
    validate(yaml.safe_load((REPO / name).read_text()), schema=str(SCHEMA))


def test_a_config_per_target_family_fixture():
    folders = {folder.name for folder in (REPO / "tests/fixtures/targets").iterdir() if folder.is_dir()}
    assert {name.split("/")[-1].removesuffix(".yaml") for name in TARGET_CONFIGS} == folders


def test_no_default_profile_overrides_the_chosen_one():
    assert not (REPO / "profiles" / "default").exists()
