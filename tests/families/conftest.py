"""The target families' tier (`families`): one workflow run per family, on a tiny model of its architecture
with its real tokenizer and chat template (config/targets/<family>.yaml as shipped, but for the evaluate
stage, which only the families in EVALUATED keep, its draft trained EVALUATE_STEPS steps: the tier's CI
time). The runs go two at a time from the first test on (each is a chain of single-core jobs); every test
here is marked `families`, and `make test` runs the folder in its run of the main suite but for the demo's tests."""

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO, copy_workflow, run
from tests.helpers.families import EVALUATED, FAMILIES, family_config, partition

RUNS_AT_ONCE = 2
# The evaluated families' SpecForge training steps (the shipped configs' 10): their test reads the draft's
# figures, whose assertions hold for any trained draft (an acceptance length is at least 1).
EVALUATE_STEPS = 4


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.families)


def run_family(work: Path, family: str) -> Path:
    """The workflow copied into `work` and run with config/targets/{family}.yaml up to what the tests read:
    both exports, the probe and, for EVALUATED, the evaluation (EVALUATE_STEPS steps; not the report's pages)."""
    copy_workflow(work)
    (work / "tests" / "fixtures").mkdir(parents=True)
    (work / "tests" / "fixtures" / "targets").symlink_to(REPO / "tests" / "fixtures" / "targets")
    config = family_config(family)
    name = partition(family)
    targets = [f"results/{name}/export/{fmt}" for fmt in ("specforge", "speculators")]
    # the draft vocabulary the exports' commands name (they name it, not read it: no export waits for it)
    targets += [f"results/{name}/probe/00000.json", "results/vocab"]
    if family in EVALUATED:
        targets.append(f"results/{name}/evaluate/acceptance.json")
        config["evaluate"]["steps"] = EVALUATE_STEPS
    else:
        del config["evaluate"]
    (work / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False, allow_unicode=True))
    # a temp directory of its own: the node's capture runner lives there, one per run
    (work / ".tmp").mkdir()
    command = [str(Path(sys.executable).parent / "snakemake"), *targets, "--profile", "profiles/local"]
    run([*command, "--configfile", "config.yaml"], work, env={"TMPDIR": str(work / ".tmp")})
    return work


@pytest.fixture(scope="session")
def family_run(request, tmp_path_factory):
    """`family_run(name)`: the family's finished workflow directory. The runs of every family a selected
    test names start with the tier's first test, RUNS_AT_ONCE at a time."""
    named = {item.callspec.params.get("family") for item in request.session.items if hasattr(item, "callspec")}
    with ThreadPoolExecutor(RUNS_AT_ONCE) as pool:
        runs = {f: pool.submit(run_family, tmp_path_factory.mktemp(f) / "wf", f) for f in FAMILIES if f in named}
        yield lambda family: runs[family].result()
