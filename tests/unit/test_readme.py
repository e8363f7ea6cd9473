"""The README is a front door: the two commands first, a short path for your own data and model, the
rest in docs/ behind links that resolve; `make help` lists every target."""

import re
import subprocess

from tests.helpers import REPO, readme_commands

README = (REPO / "README.md").read_text()


def test_the_readme_opens_with_the_two_commands_and_stays_short():
    assert readme_commands() == ["make demo", "make test"]
    assert len(README.splitlines()) < 150


def test_your_data_your_model_is_under_40_lines_and_names_each_step():
    section = README.split("## Your data, your model\n", 1)[1].split("\n## ", 1)[0]
    assert len(section.strip().splitlines()) < 40
    for step in ("make install", "snakemake -n", "scripts/plan.py", "--until", "logs/", "error: "):
        assert step in section, step


def test_every_relative_link_in_the_readme_and_docs_resolves():
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name}: {target}"


def test_make_help_lists_every_target():
    makefile = (REPO / "Makefile").read_text()
    phony = set(re.search(r"^\.PHONY: (.*)$", makefile, re.M).group(1).split())
    out = subprocess.run(["make", "--no-print-directory", "help"], cwd=REPO, capture_output=True, text=True).stdout
    assert {line.split()[0] for line in out.splitlines()} == phony
