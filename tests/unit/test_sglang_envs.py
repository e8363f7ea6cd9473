"""The GPU env (envs/sglang-gpu.txt, which envs/sglang.yaml and `make node-envs` install) and the CPU test
env (envs/sglang-cpu.txt) pin the same SGLang, and the same versions of what that SGLang release pins
itself. `make check-envs` resolves both with the project in it; `make test-node-env` installs the GPU one."""

import re
from pathlib import Path

import yaml

ENVS = Path(__file__).resolve().parents[2] / "envs"


def pins(lines) -> dict[str, str]:
    found = (re.fullmatch(r"([A-Za-z0-9_.\-\[\]]+)==(\S+)", line.strip()) for line in lines)
    return {m.group(1).lower(): m.group(2) for m in found if m}


def test_gpu_and_cpu_envs_pin_the_same_sglang_and_transformers():
    gpu = pins((ENVS / "sglang-gpu.txt").read_text().splitlines())
    cpu = pins((ENVS / "sglang-cpu.txt").read_text().splitlines())
    assert gpu["sglang"] == cpu["sglang"] == "0.5.23"
    assert gpu["transformers"] == cpu["transformers"] == "5.19.0"  # sglang 0.5.23's own pin
    assert cpu["torch"] == "2.13.0" and "torch" not in gpu  # the project's CPU wheel; on the node sglang's own


def test_the_conda_env_installs_the_gpu_pins_and_the_project():
    deps = yaml.safe_load((ENVS / "sglang.yaml").read_text())["dependencies"]
    assert [d for d in deps if isinstance(d, dict)] == [{"pip": ["-r sglang-gpu.txt", "-e .."]}]
