"""Config helpers behind `rules/common.smk`, kept here so that they are importable and tested.

Each rule's `params` carry only the settings that shape its own output, so that Snakemake's
params rerun trigger invalidates exactly the partitions a config change touches.
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path

from eagle3_datagen import config_schema
from eagle3_datagen.formats import sources
from eagle3_datagen.formats.checkpoint import text_config
from eagle3_datagen.formats.files import SOURCE_SUFFIXES, InputError

BACKENDS = ("hf", "sglang", "openrouter", "dataset")
GPU_BACKENDS = ("sglang",)
ID_BACKENDS = ("hf", "sglang")  # backends that return the generated token IDs
DATASET = "dataset"  # the backend that answers each prompt with its record's own assistant turns
BASELINE_SUFFIX = "+original"


def baseline_partition(partition: str) -> str:
    """The partition trained on `partition`'s own dataset responses (`evaluate.baseline: original`). The
    schema's partition names hold no `+`, so no user partition has this name."""
    return partition + BASELINE_SUFFIX


def baseline_partitions(config: dict) -> list[str]:
    """One baseline partition per partition when `evaluate.baseline` is `original`, else none."""
    if "evaluate" not in config or config["evaluate"]["baseline"] != "original":
        return []
    return [baseline_partition(p) for p in sorted(config["partitions"])]


def prompt_partition(partition: str) -> str:
    """The partition whose prompt shards `partition` answers: a baseline partition its own partition's."""
    return partition.removesuffix(BASELINE_SUFFIX)


def partition_config(config: dict, partition: str) -> dict:
    """A partition's settings; a baseline partition's are its partition's with the `dataset` backend."""
    if partition in config["partitions"]:
        return config["partitions"][partition]
    if partition in baseline_partitions(config):
        return {**config["partitions"][prompt_partition(partition)], "backend": DATASET}
    raise KeyError(f"no partition {partition!r} in the config")


def shard_names(config: dict, partition: str) -> list[str]:
    return [f"{i:05d}" for i in range(partition_config(config, partition)["shards"])]


def inference_backend(config: dict, partition: str) -> str:
    # a partition without a backend of its own takes inference.backend
    return partition_config(config, partition).get("backend") or config["inference"]["backend"]


OUTPUT = "output"  # shapes the stage's output: in the rule's params, so a change reruns the stage
RUN = "run"  # governs only how the job runs: read at run time, a change reschedules nothing

# Every config key's kind, by its path in the schema (`*`: any partition's name): each key's `x-kind`
# in schemas/config.schema.yaml, where a key without one fails tests/unit/test_settings.py.
KINDS: dict[str, str] = config_schema.kinds()


def kind_of(path: str) -> str:
    """The kind of the config key at dotted `path` (a partition's name in place of `*`)."""
    parts = path.split(".")
    if parts[0] == "partitions" and len(parts) > 2:
        parts[1] = "*"
    key = ".".join(parts)
    if key not in KINDS:
        raise KeyError(f"config key {key!r} has no x-kind in schemas/config.schema.yaml")
    return KINDS[key]


def split(section: dict | None, path: str) -> tuple[dict, dict]:
    """`section` (the config at dotted `path`) as its output-shaping and its run-only settings."""
    output, run = {}, {}
    for key, value in (section or {}).items():
        sub = f"{path}.{key}"
        if isinstance(value, dict) and not _is_leaf(sub):
            out_part, run_part = split(value, sub)
            if out_part:
                output[key] = out_part
            if run_part:
                run[key] = run_part
        elif kind_of(sub) == OUTPUT:
            output[key] = value
        else:
            run[key] = value
    return output, run


def _is_leaf(path: str) -> bool:
    try:
        kind_of(path)
    except KeyError:
        return False
    return True


def prompt_settings(config: dict, partition: str, commit: str | None = None) -> dict:
    """The prompts rule's settings: every key that shapes the partition's prompts.

    A glob's, a directory's or a hub dataset's `source` is here, as no single input file names it (a file
    source is the rule's input: None here); a hub dataset's `commit` (its revision resolved from the cache,
    source_commits) too, so a new one reruns the partition.
    """
    part = config["partitions"][partition]
    return {
        "format": part["format"],
        # not set: None (no system prompt, no cap on prompts, the source's own subset, split and revision)
        **{key: part.get(key) for key in ("system_prompt", "max_prompts", "subset", "split", "revision")},
        "max_bad_record_rate": part["max_bad_record_rate"],
        "allow_empty": part["allow_empty"],
        "source": None if source_is_input(part["source"]) else part["source"],
        "commit": commit,
        "drop_shared_with": earlier_partitions(config, partition),
    }


def earlier_partitions(config: dict, partition: str) -> list[str]:
    """The partitions whose prompts `partition` leaves out: those before it in name order, when
    `prompts.shared_across_partitions` is `drop`; none when it is `keep` (the default)."""
    if config["prompts"]["shared_across_partitions"] != "drop":
        return []
    return [p for p in sorted(config["partitions"]) if p < partition]


def model_settings(config: dict) -> dict:
    return split(config["model"], "model")[0]


def response_settings(config: dict, partition: str) -> dict:
    """What shapes the partition's responses: its backend, sampling, that backend's output settings; for
    the `dataset` backend, the source its prompts were read from and how (no sampling: nothing is generated)."""
    backend = inference_backend(config, partition)
    if backend == DATASET:
        return {"backend": backend, DATASET: dataset_settings(config, partition), "model": model_settings(config)}
    inference = config["inference"]
    own = split(inference[backend], f"inference.{backend}")[0]
    own.pop("sampling", None)  # merged into `sampling`
    sampling = sampling_for(config, backend)
    return {"backend": backend, "sampling": sampling, backend: own, "model": model_settings(config)}


def sampling_for(config: dict, backend: str) -> dict:
    """The sampling a backend generates with: `inference.sampling`, with the keys its own `sampling` sets
    over it (e.g. an API that takes only temperature 1 beside a greedy local server)."""
    return {**config["inference"]["sampling"], **((config["inference"].get(backend) or {}).get("sampling") or {})}


def dataset_settings(config: dict, partition: str) -> dict:
    """Where the `dataset` backend reads the records of a partition's prompts, and how they were parsed."""
    part = partition_config(config, partition)
    settings = {"source": part["source"], "format": part["format"], "system_prompt": part.get("system_prompt")}
    settings.update({k: part[k] for k in ("subset", "split", "revision") if part.get(k) is not None})
    return settings


# The run's ledgers (backends/ledger.py): one per endpoint, shared by every responses job of the run.
LEDGER_DIR = "results/.ledger"


def response_run_settings(config: dict) -> dict:
    """What governs a responses job, for every backend (a job reads its own backend's), the GPUs a
    launched server's job step asks for under SLURM, and how it waits for their memory."""
    inference = config["inference"]
    # openrouter has settings without a default: absent where no partition uses it
    run = {b: split(inference.get(b), f"inference.{b}")[1] for b in BACKENDS}
    return {
        "token_budget": inference.get("token_budget"),  # absent: no budget
        "max_failed_rate": inference["max_failed_rate"],
        "ledger_dir": LEDGER_DIR,
        "gpus": config["resources"]["gpus_per_node"],
        "handover": config["resources"]["handover"],
        **run,
    }


def served_by_launched_server(config: dict, partition: str) -> bool:
    """Partitions whose responses come from the SGLang server the workflow launches for them."""
    return inference_backend(config, partition) == "sglang" and "launch" in config["inference"]["sglang"]


def token_settings(config: dict) -> dict:
    return {"tokens": split(config["tokens"], "tokens")[0], "model": model_settings(config)}


def hidden_settings(config: dict) -> dict:
    """What shapes hidden states; of the backends' own sections, only the configured backend's."""
    hidden = dict(config["hidden_states"])
    backend = hidden["backend"]
    for other in ("hf", "sglang"):
        if other != backend:
            hidden.pop(other, None)
    return {"hidden_states": split(hidden, "hidden_states")[0], "model": model_settings(config)}


def hidden_run_settings(config: dict) -> dict:
    """The capture's run-only settings, the GPUs its runner takes (SGLang's tensor-parallel size) and how it
    waits for their memory."""
    return {
        "hidden_states": split(config["hidden_states"], "hidden_states")[1],
        "tensor_parallel": gpus_for(config, "hidden_states") or 1,
        "handover": config["resources"]["handover"],
    }


def probe_settings(config: dict, partition: str) -> dict:
    """The probe's thresholds, and whether the partition's data is greedy with exact output IDs."""
    backend = inference_backend(config, partition)
    greedy_exact = (
        backend in ID_BACKENDS
        and sampling_for(config, backend)["temperature"] == 0.0
        and config["tokens"]["prefer_ids"] == "server"
    )
    return {
        "probe": split(config["probe"], "probe")[0],
        "backend": backend,
        "greedy_exact": greedy_exact,
        "model": {"path": config["model"]["path"]},
    }


def export_settings(config: dict, fmt: str) -> dict:
    """What shapes an export of `fmt` beyond its inputs: SpecForge's rows' compression (speculators: nothing)."""
    return {"specforge": split(config["export"]["specforge"], "export.specforge")[0]} if fmt == "specforge" else {}


def probe_run_settings(config: dict) -> dict:
    return {"probe": split(config["probe"], "probe")[1]}


RUN_SETTINGS_ENV = "EAGLE3_DATAGEN_RUN_SETTINGS"


def run_settings(config: dict) -> dict:
    """Every stage's run-only settings, by the name its job asks for them under."""
    return {
        "responses": response_run_settings(config),
        "hidden_states": hidden_run_settings(config),
        "probe": probe_run_settings(config),
        "evaluate": split(config.get("evaluate"), "evaluate")[1],
    }


def merged(settings: dict, run: dict) -> dict:
    """A job's settings: the rule's output-shaping ones with the run-only ones read at run time."""
    out = dict(settings)
    for key, value in run.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def uses_gpu(config: dict, stage: str, partition: str | None = None) -> bool:
    if stage == "responses":
        backend = inference_backend(config, partition)
        if backend in GPU_BACKENDS:
            return True
        return backend == "hf" and config["inference"]["hf"]["device"] == "cuda"
    hidden = config["hidden_states"]
    return hidden["backend"] in GPU_BACKENDS or hidden["hf"]["device"] == "cuda"


def gpus_for(config: dict, stage: str, partition: str | None = None) -> int:
    """GPUs a job of `stage` asks for; only the responses stage depends on the partition."""
    return config["resources"]["gpus_per_node"] if uses_gpu(config, stage, partition) else 0


# What the GPU stages' jobs start on their node (their node service) and so launch themselves, a process
# per GPU: the slurm plugin's name for such a job's launcher.
LAUNCHERS = {"hidden_states": "torchrun", "responses_sglang_server": "sglang.launch_server"}


def slurm_resources(config: dict, gpus: int) -> dict:
    """Where a job goes under SLURM (`resources.slurm`): a job that asks for GPUs to the GPU partition and its
    QoS, any other to the CPU one's, both under the account; as the slurm executor plugin's resources
    (`slurm_partition`, `qos`, `slurm_account`), those not set left out. Local runs ignore them."""
    slurm = config["resources"]["slurm"]
    where = slurm["gpu" if gpus else "cpu"]
    asked = {"slurm_partition": where["partition"], "qos": where["qos"], "slurm_account": slurm["account"]}
    return {key: value for key, value in asked.items() if value is not None}


def cluster_job(config: dict, rule: str, gpus: int) -> dict:
    """What a heavy rule's cluster job asks for: `resources.jobs.<rule>` (memory, CPUs and minutes of the
    job) where `slurm_resources` sends it. A job on more than one GPU of its node is one that launches its
    own processes, one task per GPU (the plugin's `mpi` jobs): the slurm-jobstep executor runs such a job in
    its allocation's batch step instead of a job step of its own, so the node service it starts outlives it
    and serves the allocation's next shard jobs (SLURM kills what a job step leaves behind when the step
    ends). Its CPUs are asked for per task. Local runs ignore all of these."""
    job = dict(config["resources"]["jobs"][rule]) | slurm_resources(config, gpus)
    if gpus > 1:
        job.update(mpi=LAUNCHERS[rule], tasks_per_node=gpus, cpus_per_task=max(1, job["cpus_per_task"] // gpus))
    return job


def spread_over_nodes(workflow, group: str, rule: str, nodes: int) -> None:
    """Set how many jobs of `group` go to one group job (Snakemake's --group-components) so that the scheduled
    jobs of `rule` spread over `nodes` nodes: ceil(jobs / nodes) each. Called while Snakemake forms its group
    jobs (by the rule's `group` function, once the jobs it will run are known: a rerun after a crash spreads
    what is left), once per run, never over a count given on the command line. `workflow`: Snakemake's."""
    settings = workflow.group_settings
    if group not in settings.group_components:
        jobs = sum(job.rule.name == rule for job in workflow.dag.needrun_jobs())
        settings.group_components = {**settings.group_components, group: max(1, math.ceil(jobs / nodes))}


def demo_fit_partitions(config: dict) -> list[dict]:
    """What the demo model is fitted to, per partition: the Qwen3 demo learns the sources' own
    conversations; a target built from a tokenizer folder (the tiny Kimi, the families' tiny targets)
    learns the prompts as the prompts stage builds them, so a partition's system prompt changes it (and
    only it)."""
    keys = ("source", "format", "system_prompt") if "tokenizer" in config["demo"] else ("source", "format")
    return [{k: config["partitions"][p].get(k) for k in keys} for p in sorted(config["partitions"])]


# The model settings a target built from a tokenizer folder renders its fitting prompts with, as the run does.
DEMO_CHAT_KEYS = ("chat_template_kwargs", "chat_template_date", "family")


def demo_settings(config: dict) -> dict:
    """The demo model builder's settings: the `demo` section, and for a target built from a tokenizer folder
    the model's chat settings (`chat`), so that it is fitted to the prompts the run renders."""
    if "tokenizer" not in config["demo"]:
        return config["demo"]
    return {**config["demo"], "chat": {key: config["model"][key] for key in DEMO_CHAT_KEYS}}


def source_is_input(source: str) -> bool:
    """A file source is the prompts rule's input and its command's --source; a glob's, a directory's and
    a hub dataset's `source` is in the rule's settings."""
    return not (sources.is_hub(source) or sources.is_glob(source) or Path(source).is_dir())


def source_inputs(config: dict, partition: str) -> list[str]:
    """The prompts rule's source inputs: the file, a glob's files, every file in a directory (so one
    rewritten in place reruns the partition, which the directory's own time would not show; hidden
    ones, such as a download's `.cache/`, left out), none for a hub dataset."""
    source = config["partitions"][partition]["source"]
    if sources.is_hub(source):
        return []
    if sources.is_glob(source):
        return sources.glob_files(source)
    if Path(source).is_dir():
        files = []
        for root, dirs, names in os.walk(source):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            files += [os.path.join(root, name) for name in names if not name.startswith(".")]
        return sorted(files)
    return [source]


@functools.cache
def _hub_commit(repo: str, revision: str | None) -> str | InputError:
    try:
        return sources.hub_commit(repo, revision)
    except InputError as error:
        return error


def source_commits(config: dict) -> dict[str, str]:
    """Each hub-dataset partition's commit, its revision resolved from the Hugging Face cache's refs
    (or the hub, with a network, when the cache lacks it); missing_sources reports those that fail."""
    commits = {}
    for name, part in config["partitions"].items():
        if sources.is_hub(part["source"]):
            commit = _hub_commit(sources.hub_repo(part["source"]), part.get("revision"))
            if isinstance(commit, str):
                commits[name] = commit
    return commits


def missing_sources(config: dict, config_files: list) -> list[str]:
    """One message per partition whose source cannot be read, naming what to fix: a path that does
    not exist, a glob that matches nothing, a file of no known type, a hub dataset not in the cache."""
    where = ", ".join(str(f) for f in config_files)
    problems = []
    for name, part in sorted(config["partitions"].items()):
        source = part["source"]
        if sources.is_hub(source):
            commit = _hub_commit(sources.hub_repo(source), part.get("revision"))
            if isinstance(commit, InputError):
                problems.append(f"partition {name!r}: {commit} (set in {where})")
            continue
        if sources.is_glob(source):
            if not sources.glob_files(source):
                problems.append(
                    f"partition {name!r}: source {source!r} matches no file (set in {where}; resolved from "
                    f"{Path.cwd()}). Fix the pattern, or put the files there."
                )
        elif not Path(source).exists():
            problems.append(
                f"partition {name!r}: source {source!r} does not exist (set in {where}; "
                f"resolved from {Path.cwd()}). Fix the path, or put the file there."
            )
        elif Path(source).is_file() and not source.endswith(SOURCE_SUFFIXES):
            problems.append(
                f"partition {name!r}: source {source!r} is of no type the prompts stage reads (set in {where}). "
                f"Fix: use one of {', '.join(SOURCE_SUFFIXES)}, a directory of them, a `save_to_disk` "
                "directory or hf:owner/name (docs/sources.md)."
            )
        for key in ("subset", "split", "revision"):
            if part.get(key) is not None and not _takes(source, key):
                problems.append(
                    f"partition {name!r}: `{key}` applies to {_TAKES[key]}, not to source {source!r} "
                    f"(set in {where}). Fix: remove it, or point `source` at such a dataset."
                )
    return problems


_TAKES = {
    "subset": "a hub dataset (hf:owner/name) or a dataset directory",
    "split": "a hub dataset (hf:owner/name) or a dataset directory",
    "revision": "a hub dataset (hf:owner/name)",
}


def _takes(source: str, key: str) -> bool:
    if sources.is_hub(source):
        return True
    return key != "revision" and not sources.is_glob(source) and Path(source).is_dir()


# The only folder the demo may build its model in: Snakemake removes a directory() output before the job
# that rebuilds it, so a demo pointed at a user's own model directory would delete it.
DEMO_MODEL_ROOT = "results"


def config_problems(config: dict, config_files: list, check_sources: bool) -> list[str]:
    """What the Snakefile refuses before any job, one message each: a source that cannot be read
    (`check_sources`: not with an object store as default storage, whose plugin checks its objects
    itself), settings that would delete a model the workflow did not make, or that no reader (or the
    evaluate stage) could take."""
    missing = missing_sources(config, config_files) if check_sources else []
    problems = demo_model_problems(config) + storage_problems(config) + evaluate_problems(config)
    return missing + problems + gate_problems(config)


def gate_problems(config: dict) -> list[str]:
    """A repetition gate that could judge no text: its window holds fewer n-grams than it asks for."""
    repetition = config["tokens"]["gates"]["repetition"]
    holds = repetition["window"] - repetition["n"] + 1
    if not repetition["enabled"] or repetition["min_ngrams"] <= holds:
        return []
    return [
        f"tokens.gates.repetition: a window of {repetition['window']} words holds {holds} {repetition['n']}-grams, "
        f"fewer than min_ngrams {repetition['min_ngrams']}, so no text would be judged; raise window or lower "
        "min_ngrams (or set enabled: false)"
    ]


def demo_model_problems(config: dict) -> list[str]:
    """A config with a `demo:` block builds its model at `model.path`: refused unless that path lies under
    results/, the workflow's own folder, so that no run can replace a model the workflow did not make."""
    if "demo" not in config:
        return []
    path = config["model"]["path"]
    parts = Path(path).parts
    if len(parts) > 1 and parts[0] == DEMO_MODEL_ROOT and ".." not in parts:
        return []
    return [
        f"model.path {path!r} with a demo: block: the demo builds (and rebuilds, deleting the old one) its tiny "
        f"model at model.path, so it must lie under {DEMO_MODEL_ROOT}/ (e.g. {DEMO_MODEL_ROOT}/demo/model). To run "
        "your own model, delete the demo: block from your config and keep model.path; to run the demo, set "
        f"model.path: {DEMO_MODEL_ROOT}/demo/model."
    ]


def as_json(settings: dict) -> str:
    """Canonical JSON, so equal settings always compare equal in Snakemake's params trigger."""
    return json.dumps(settings, sort_keys=True, separators=(",", ":"))


def storage_problems(config: dict) -> list[str]:
    """One message per hidden-state setting that a reader or an export could not take, naming the
    fix; checked before any job, so nothing is captured that cannot be used."""
    hidden = config["hidden_states"]
    problems = []
    if "speculators" in config["export"]["formats"] and hidden["final"] == "normed":
        problems.append(
            "hidden_states.final: normed cannot be exported to speculators: speculators 0.9.0 applies the "
            "verifier's final norm to the last slot itself and would norm it twice. Set hidden_states.final: raw "
            "(the specforge export applies the norm where SpecForge needs it), or drop speculators from export.formats."
        )
    dtype, scales = hidden["dtype"], hidden["scales"]
    if dtype.startswith("float8") and scales == "block":
        hidden_size = demo_or_model_hidden_size(config)
        block = hidden["scale_block"]
        if hidden_size is not None and hidden_size % min(block, hidden_size):
            problems.append(
                f"hidden_states.scale_block {block} does not divide the model's hidden size {hidden_size}: "
                "set a scale_block that divides it (or scales: token)."
            )
    return problems


def demo_or_model_hidden_size(config: dict) -> int | None:
    """The target's hidden size, where it is known before any job (the demo's config, or a model
    directory that already exists)."""
    if "demo" in config:
        return config["demo"]["hidden_size"]
    model_dir = Path(config["model"]["path"])
    return int(text_config(model_dir)["hidden_size"]) if (model_dir / "config.json").exists() else None


# The interpreter that runs scripts/evaluate.py (SpecForge's venv), set by rules/common.smk for every
# process that parses the workflow: a run-only setting, so it reaches the jobs' shell through the
# environment rather than their command's text (a changed command reruns a job).
SPECFORGE_PYTHON_ENV = "EAGLE3_DATAGEN_SPECFORGE_PYTHON"


def evaluate_settings(config: dict) -> dict:
    """What shapes an evaluation (every `evaluate` key but the interpreter); {} without the stage."""
    return split(config.get("evaluate"), "evaluate")[0]


def evaluate_problems(config: dict) -> list[str]:
    """Evaluate settings no job could run, refused before any job."""
    if "evaluate" not in config:
        return []
    speculative = config["evaluate"]["speculative"]
    found = []
    if speculative["topk"] != 1:
        found.append(
            f"evaluate.speculative.topk is {speculative['topk']}: the CPU evaluation decodes one chain of "
            "proposals (greedy, SGLang's topk 1); set it to 1"
        )
    return found
