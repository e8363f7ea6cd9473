"""The package's layout holds: imports point down, no test double in the runtime, every import pinned."""

import ast
import re
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.helpers import REPO

PACKAGE = REPO / "src" / "eagle3_datagen"
# sglang is imported only inside the SGLang backends, which run in their own env (envs/sglang.yaml,
# envs/sglang-cpu.txt), specforge only inside the evaluate stage, which runs in SpecForge's
# (envs/specforge-cpu.txt); everything else the package imports is a runtime dependency.
OWN_ENV = {"sglang", "specforge", "vllm"}


def imports(path: Path) -> set[str]:
    """Absolute module names `path` imports, at any depth (lazy imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO / "src").with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports() -> dict[str, set[str]]:
    return {module_name(p): imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_no_stage_is_imported_but_by_its_own_package_and_scripts():
    for module, imported in package_imports().items():
        for name in imported:
            if name.startswith("eagle3_datagen.stages."):
                stage = ".".join(name.split(".")[:3])
                assert module.startswith(stage), f"{module} imports the stage {name}"


def test_no_test_double_in_the_runtime_package():
    for module, imported in package_imports().items():
        assert not any(name == "tests" or name.startswith("tests.") for name in imported), module


def test_shared_pieces_import_no_backend_stage_or_target():
    """chat/ and formats/ are the bottom: they import nothing above them."""
    above = ("eagle3_datagen.stages", "eagle3_datagen.backends", "eagle3_datagen.targets", "eagle3_datagen.reporting")
    for module, imported in package_imports().items():
        if module.startswith(("eagle3_datagen.chat", "eagle3_datagen.formats")):
            assert not [name for name in imported if name.startswith(above)], module


def backend_packages() -> set[str]:
    """The packages of the registered backends' implementations (eagle3_datagen.backends.sglang, ...)."""
    from eagle3_datagen.backends.plugins import CAPTURE, GENERATION

    paths = [e.implementation for e in [*GENERATION.values(), *CAPTURE.values()] if e.implementation]
    modules = {path.split(":")[0] for path in paths}
    return {m if m.count(".") == 2 else m.rsplit(".", 1)[0] for m in modules}


def test_the_workflow_reads_the_backends_through_their_registry():
    """workflow/, the Snakefile and its rules name no backend's own module: what a backend needs of them
    (its importability, its launcher, its env, its names) is on its registry entry (backends/plugins.py),
    so adding one touches its module, its entry and the schema only."""
    implementations = backend_packages()
    assert {"eagle3_datagen.backends.sglang", "eagle3_datagen.backends.openrouter"} <= implementations
    workflow_files = {REPO / "Snakefile": "Snakefile", **{p: p.name for p in (REPO / "rules").glob("*.smk")}}
    imported = {
        module: names for module, names in package_imports().items() if module.startswith("eagle3_datagen.workflow")
    }
    # Snakemake's files are not Python: their import lines, read as lines
    imported |= {
        name: set(re.findall(r"^(?:from|import) +([\w.]+)", path.read_text(), re.M))
        for path, name in workflow_files.items()
    }
    for module, names in imported.items():
        assert not [n for n in names if n.startswith(tuple(implementations))], module


def test_every_third_party_import_is_a_declared_dependency_pinned_in_its_range():
    """pyproject.toml declares a range for each (the versions the tiers test); envs/requirements.txt, the
    lock file `make install` installs, pins one inside it."""
    stdlib = set(sys.stdlib_module_names)
    top_level = {name.split(".")[0] for imported in package_imports().values() for name in imported}
    third_party = sorted(top_level - stdlib - {"eagle3_datagen"} - OWN_ENV)
    distributions = packages_distributions()
    declared = [
        Requirement(line) for line in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    ]
    ranges = {canonicalize_name(r.name): r.specifier for r in declared}
    assert all(len(s) == 2 and {c.operator for c in s} == {">=", "<"} for s in ranges.values()), declared
    requirements = {
        canonicalize_name(line.split("==")[0].split("[")[0]): line.split("==")[1]
        for line in (REPO / "envs" / "requirements.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    }
    for module in third_party:
        dists = {canonicalize_name(d) for d in distributions.get(module, [])}
        assert dists & set(ranges), f"{module} ({dists}) is imported but not a dependency in pyproject.toml"
        assert dists & set(requirements), f"{module} ({dists}) is imported but not pinned in envs/requirements.txt"
    for name, specifier in ranges.items():
        assert requirements.get(name) in specifier, (
            f"{name}{specifier}: envs/requirements.txt pins {requirements.get(name)}"
        )


def test_status_and_plan_load_no_torch():
    """scripts/status.py only calls Snakemake and reads files, and scripts/plan.py loads the tokenizer
    only once Snakemake has answered: torch (seconds to import) is not loaded to start either."""
    for script in ("status.py", "plan.py"):
        code = (
            f"import runpy, sys; sys.argv = ['{script}', '--help']\n"
            f"try:\n    runpy.run_path({str(REPO / 'scripts' / script)!r}, run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules)"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        assert out.splitlines()[-1] == "False False", script


TESTS = REPO / "tests"
TIERS = {"unit", "workflow", "slurm", "bench", "families", "real_sglang", "real_vllm", "trainers", "node_env"}


def test_every_test_file_is_in_a_tier_folder_and_no_test_imports_a_conftest():
    """Each tier is a folder with the fixtures only it uses (docs/development.md); what tests share is in
    tests/helpers, so that a tier's fixtures never load into another's through an import."""
    test_files = TESTS.rglob("test_*.py")
    outside = [str(path.relative_to(REPO)) for path in test_files if path.relative_to(TESTS).parts[0] not in TIERS]
    assert not outside, f"{outside}: move each into its tier's folder, one of tests/{sorted(TIERS)}"
    for path in sorted(TESTS.rglob("*.py")):
        if "fixtures" in path.relative_to(TESTS).parts:
            continue
        tree = ast.parse(path.read_text())
        relative = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level and n.module]
        absolute = {name.split(".")[-1] for name in imports(path)}
        assert "conftest" not in absolute and not [m for m in relative if m.split(".")[-1] == "conftest"], (
            f"{path.relative_to(REPO)} imports a conftest: move what it takes into tests/helpers"
        )
