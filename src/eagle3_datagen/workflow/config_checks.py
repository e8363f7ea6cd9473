"""What the Snakefile refuses before any job: sources that cannot be read, a demo that would replace a model
it did not make, and settings that no reader, export or job could take; one message each, naming the fix."""

from __future__ import annotations

from pathlib import Path

from eagle3_datagen.backends.service import launch_args
from eagle3_datagen.formats import sources
from eagle3_datagen.formats.checkpoint import text_config
from eagle3_datagen.formats.files import SOURCE_SUFFIXES, InputError
from eagle3_datagen.formats.trainer_exports import EXPORTS
from eagle3_datagen.workflow.partitions import hub_commit_or_error, inference_backend


def missing_sources(config: dict, config_files: list) -> list[str]:
    """One message per partition whose source cannot be read, naming what to fix: a path that does
    not exist, a glob that matches nothing, a file of no known type, a hub dataset not in the cache."""
    where = ", ".join(str(f) for f in config_files)
    problems = []
    for name, part in sorted(config["partitions"].items()):
        source = part["source"]
        if sources.is_hub(source):
            commit = hub_commit_or_error(sources.hub_repo(source), part.get("revision"))
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
    itself), settings that would delete a model the workflow did not make, or that no reader could
    take."""
    missing = missing_sources(config, config_files) if check_sources else []
    problems = demo_model_problems(config) + storage_problems(config)
    return missing + problems + gate_problems(config) + one_pass_problems(config)


def gate_problems(config: dict) -> list[str]:
    """A repetition gate that could judge no text: its window holds fewer words than it asks for."""
    repetition = config["tokens"]["gates"]["repetition"]
    if not repetition["enabled"] or repetition["min_words"] <= repetition["window"]:
        return []
    return [
        f"tokens.gates.repetition: a window of {repetition['window']} words is shorter than min_words "
        f"{repetition['min_words']}, so no text would be judged; raise window or lower min_words (or set "
        "enabled: false)"
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


def storage_problems(config: dict) -> list[str]:
    """One message per hidden-state setting that a reader or an export could not take, naming the
    fix; checked before any job, so nothing is captured that cannot be used."""
    hidden = config["hidden_states"]
    problems = []
    for fmt in config["export"]["formats"]:
        export = EXPORTS[fmt]
        if hidden["final"] not in export.finals:
            problems.append(
                f"hidden_states.final: {hidden['final']} cannot be exported to {fmt}: {export.final_reason}. Set "
                f"hidden_states.final: {export.finals[0]} (the other exports apply the final norm where their trainer "
                f"needs it), or drop {fmt} from export.formats."
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


# A one-pass server's flags that the workflow sets itself (backends/vllm/one_pass.server_args): prefix caching
# would let a request reuse cached blocks whose states it never computed, and the others are the extraction.
ONE_PASS_OWN_FLAGS = ("--enable-prefix-caching", "--speculative-config", "--kv-transfer-config")


def one_pass_problems(config: dict) -> list[str]:
    """What `hidden_states.one_pass` cannot serve, refused before any job: no partition answered by a vLLM
    server the workflow launches (a server at a URL may write its files where the jobs cannot read them, and
    was started with flags the workflow does not know), a final slot after the norm (the server saves the
    norm's input), the layer check (no model runs in the capture job), seeded sampling (with extraction on
    it did not reproduce its own answers in the issue's trial: the states and ids would disagree), and
    launch flags that the extraction needs set its own way."""
    hidden = config["hidden_states"]
    if not hidden["one_pass"]:
        return []
    served = [name for name in sorted(config["partitions"]) if inference_backend(config, name) == "vllm"]
    if not served:
        return ["hidden_states.one_pass: no partition is answered by inference backend vllm; set it false"]
    problems = []
    section = config["inference"].get("vllm") or {}
    if "launch" not in section:
        problems.append(
            f"hidden_states.one_pass: partitions {served} are answered by a vLLM server at a URL; one pass needs "
            "the server the workflow launches (inference.vllm.launch), which it starts with the extraction "
            "settings and whose files its jobs read. Add a launch block, or set one_pass: false"
        )
    launch = section.get("launch")  # filled by the schema where present
    flags = [*launch_args(launch), *launch["run_args"]] if launch else []
    for flag in ONE_PASS_OWN_FLAGS:
        if any(arg == flag or arg.startswith(f"{flag}=") for arg in flags):
            problems.append(
                f"hidden_states.one_pass: inference.vllm.launch sets {flag}, which one pass sets itself "
                "(prefix caching off, the extraction's speculative and KV transfer configs): remove it"
            )
    if hidden["final"] != "raw":
        problems.append(
            "hidden_states.one_pass: the server saves layer N before the final norm: set hidden_states.final: raw "
            "(the specforge export applies the norm)"
        )
    if hidden["layer_check_samples"]:
        problems.append(
            "hidden_states.one_pass: no model runs in a one-pass capture job, so the layer check cannot: set "
            "hidden_states.layer_check_samples: 0"
        )
    sampling = {**config["inference"]["sampling"], **(section.get("sampling") or {})}
    if sampling["temperature"] > 0 and sampling.get("seed") is not None:
        problems.append(
            f"hidden_states.one_pass: seeded sampling (temperature {sampling['temperature']}, seed "
            f"{sampling['seed']}) does not reproduce with vLLM's extraction on: use greedy (temperature: 0), or "
            "drop the seed, or set one_pass: false"
        )
    return problems
