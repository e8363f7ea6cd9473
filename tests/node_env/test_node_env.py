"""The GPU node's SGLang environment (.venv-gpu, `make node-envs`), built on this CPU machine as the node
builds it (PyPI's CUDA torch installs without a GPU): it holds what envs/sglang-gpu.txt pins, SGLang's
own CUDA torch, and everything the node runs from it imports there: each SGLang name the project
imports, `python -m sglang.launch_server`, the capture runner, the smoke run and Snakemake with its
plugins (a dry run of the demo). Nothing here needs a GPU: imports, --help and a dry run
(`make test-node-env`)."""

import ast
import importlib
import importlib.util
import re
import subprocess
import sys
from importlib.metadata import requires, version
from pathlib import Path

import pytest
import torch

from tests.helpers import copy_workflow

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def pins(path: Path) -> dict[str, str]:
    found = (re.fullmatch(r"([A-Za-z0-9_.\-]+)==(\S+)", line.strip()) for line in path.read_text().splitlines())
    return {m.group(1): m.group(2) for m in found if m}


def sglang_imports() -> dict[str, set[str]]:
    """Each `sglang` module the project's code imports (src/ and scripts/), with the names it takes from it."""
    found: dict[str, set[str]] = {}
    for path in [*(ROOT / "src").rglob("*.py"), *(ROOT / "scripts").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "sglang":
                found.setdefault(node.module, set()).update(a.name for a in node.names)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "sglang":
                        found.setdefault(alias.name, set())
    return found


def test_the_env_holds_its_pins_and_sglangs_cuda_torch():
    pinned = pins(ROOT / "envs" / "sglang-gpu.txt")
    assert {name: version(name) for name in pinned} == pinned
    assert pinned["sglang"] == "0.5.23" and pinned["transformers"] == "5.19.0"
    torch_pin = next(r for r in requires("sglang") if re.match(r"torch\s*==", r))
    assert torch.__version__.split("+")[0] == torch_pin.split("==")[1].strip() == "2.14.1"
    assert torch.version.cuda, f"torch {torch.__version__} is not a CUDA build"
    assert version("eagle3-datagen") == "0.1.0"


def test_every_sglang_name_the_project_imports_is_there():
    imports = sglang_imports()
    # the capture runner: its model runner, the batches it extends, the states it takes
    assert sum(len(names) for names in imports.values()) >= 20, imports
    for module in imports:
        importlib.import_module(module)
    missing = [f"{module}.{name}" for module, names in imports.items() for name in names if not found(module, name)]
    assert not missing


def found(module: str, name: str) -> bool:
    """`from module import name` works: an attribute of the module, or a submodule of it."""
    if hasattr(importlib.import_module(module), name):
        return True
    submodule = f"{module}.{name}"
    return importlib.util.find_spec(submodule) is not None and bool(importlib.import_module(submodule))


def test_the_launched_server_module_is_there():
    """The generation server runs `python -m sglang.launch_server` (its registry entry's launcher)."""
    from eagle3_datagen.backends.plugins import GENERATION

    command = GENERATION["sglang"].launch_command({}, sys.executable)
    assert command[command.index("-m") + 1] == "sglang.launch_server"
    assert importlib.import_module("sglang.launch_server").__file__


@pytest.mark.parametrize(
    ("script", "says"),
    [("capture_runner.py", "The node's capture runner"), ("smoke.py", "--configfile"), ("gpu_check.py", "usage:")],
)
def test_the_node_scripts_start(script, says):
    """The capture runner (under torchrun), the smoke run and its GPU check, each as the node starts it."""
    done = subprocess.run(
        [sys.executable, f"scripts/{script}", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert says in done.stdout


def test_the_project_modules_the_node_runs_import():
    for module in (
        "eagle3_datagen.backends.sglang.capture",
        "eagle3_datagen.backends.sglang.generate",
        "eagle3_datagen.backends.sglang.server",
        "eagle3_datagen.stages.hidden.runner",
    ):
        assert importlib.import_module(module).__file__


def test_snakemake_torchrun_and_the_plugins():
    done = subprocess.run([BIN / "snakemake", "--version"], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == pins(ROOT / "envs" / "sglang-gpu.txt")["snakemake"]
    for plugin in ("snakemake_executor_plugin_slurm", "snakemake_storage_plugin_s3"):
        assert importlib.import_module(plugin).__file__
    done = subprocess.run([BIN / "torchrun", "--help"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "--nproc-per-node" in done.stdout


def test_snakemake_here_plans_the_workflow(tmp_path):
    """The node runs Snakemake itself from this env: it loads the Snakefile, validates the config with the
    schema and plans every job of the demo (a dry run, on a copy of the workflow)."""
    work = copy_workflow(tmp_path / "work")
    done = subprocess.run(
        [BIN / "snakemake", "-n", "--profile", "profiles/local"], cwd=work, capture_output=True, text=True, timeout=600
    )
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-3000:]
    assert re.search(r"^hidden_states\s+[1-9]\d*$", said, re.M) and re.search(r"^total\s+\d+$", said, re.M), said[
        -3000:
    ]
