"""Preflight: what would fail a scheduled job later, found before the first job runs.

The Snakefile calls `problems` twice: in `onstart`, where Snakemake has built the DAG and a
real run stops on any problem before its first job (only the jobs it will run count: an OpenRouter
key is needed only while OpenRouter responses are scheduled); and at parse time in a dry-run
(`snakemake -n`, which calls no `onstart`), where each problem is printed as a warning, so that a
preview on a laptop without the key or the model still works. The dry-run does not know which jobs
are up to date, so it counts every job the config's workflow has.

The disk check needs no plan: it counts the bytes of the shards and exports the jobs write from the
tokens stage's measured counts, before those exist from the responses' usage, before those bounds them
from the prompts, and before the prompts exist (a first run) estimates them from the sources' records
(workflow/disk.py), less what the outputs they replace hold, against the room on the filesystem each
output goes to: its free space, or less where the user's quota (workflow/quota.py) or
`resources.disk_quota_bytes` leaves less. Each capture job checks its own shard the same way before it
writes (scripts/hidden_states.py). A probe or export
that needs the states of shards whose parts were removed after the exports (hidden_states.keep_shards:
false) stops a run too, naming the price of capturing them again; a probe re-judged or an export rebuilt
from the kept copy does not.

Each problem is one line naming the setting, the value and the fix.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from eagle3_datagen.backends import ledger
from eagle3_datagen.backends.plugins import CAPTURE, GENERATION, IMPORTABLE, RESPONSE_RULES, SERVED_RESPONSE_RULE
from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.formats import storage
from eagle3_datagen.formats.files import read_json
from eagle3_datagen.formats.released import PROBE_MEASURING, RELEASED, kept_export, probe_measured_with
from eagle3_datagen.workflow import disk
from eagle3_datagen.workflow.partitions import inference_backend, launched_backends, prompt_partition, shard_names
from eagle3_datagen.workflow.rates import capture_rates, plan_rates
from eagle3_datagen.workflow.settings import one_pass_states

# Rules whose jobs read nothing of the model: the prompts (one rule per partition), the reports, and
# the demo's model builder (which makes it).
NO_MODEL_RULES = ("partition_summary", "summary", "build_demo_model", "release_hidden")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Written by scripts/plan.py (the plan's record; the disk check counts without it).
PLAN_FILE = "results/plan.json"
# A CPU build of torch can never train on a GPU, whichever node the job lands on (the submit host may
# have no GPU: whether one is visible here says nothing).
TORCH_BUILT_FOR_CUDA = "import sys, torch; sys.exit(torch.version.cuda is None)"


@dataclass(frozen=True)
class Job:
    """A job that would run: its rule and, where it has them, its partition, shard and export format
    (none: every shard, every format of the partition)."""

    rule: str
    partition: str | None = None
    shard: str | None = None
    format: str | None = None


def scheduled_jobs(dag) -> list[Job]:
    """The jobs Snakemake's `dag` will run (in `onstart`, once Snakemake has built it)."""
    jobs = []
    for job in dag.needrun_jobs():
        wildcards = job.wildcards_dict
        jobs.append(Job(job.rule.name, wildcards.get("partition"), wildcards.get("shard"), wildcards.get("format")))
    return jobs


def config_jobs(config: dict) -> list[Job]:
    """Every job kind the config's workflow has, one per rule and partition: what a dry-run checks."""
    jobs = []
    for p in config["partitions"]:
        responses = GENERATION[inference_backend(config, p)].rule(config)
        jobs += [Job(f"prompts_{p}", p), Job(responses, p), Job("tokens", p), Job("hidden_states", p)]
        jobs += [Job("probe", p), Job("partition_summary", p), Job("export", p)]
    if "evaluate" in config:
        jobs += [Job("evaluate", p) for p in config["partitions"]]
    return [*jobs, Job("summary"), *([Job("vocab_mapping")] if "vocab_mapping" in config else [])]


def problems(
    config: dict,
    jobs: Iterable[Job],
    environ: Mapping[str, str],
    envs_deployed: bool,
    results: str | Path = "results",
    scheduled: bool = True,
) -> list[str]:
    """One line per thing that would fail one of `jobs` later, with its fix. `scheduled`: `jobs` are the
    jobs this run will run (onstart), not every job kind of the config (a dry-run's).

    `envs_deployed`: a deployment method of the run (`--sdm conda`) brings each job its backend's env (a
    launched server's and the capture runner's: envs/<env>.yaml of their registry entries), and SpecForge to
    the evaluate jobs (envs/specforge.yaml); else the job's own `python` must import its backend and
    evaluate.python must exist; evaluate.device: cuda needs a CUDA build of torch in whichever runs the
    evaluate jobs.
    """
    jobs = list(jobs)
    found = []
    openrouter = priced_partitions(config, jobs)
    if openrouter:
        found += _openrouter_problems(config, openrouter, environ)
    if "demo" not in config and any(not j.rule.startswith("prompts_") and j.rule not in NO_MODEL_RULES for j in jobs):
        found += _model_problems(config["model"]["path"])
        found += _template_problems(config["model"]["path"], config["model"])
    elif "demo" in config and "tokenizer" in config["demo"]:  # a target built from this tokenizer folder
        found += _template_problems(config["demo"]["tokenizer"], config["model"])
    if not envs_deployed:
        found += _backend_import_problems(config, jobs, environ)
    found += _specforge_problems(config, jobs, environ, envs_deployed)
    found += _disk_problems(config, jobs, Path(results), environ)
    if scheduled:
        found += _released_problems(config, jobs, Path(results))
    return found


def priced_partitions(config: dict, jobs: Iterable[Job]) -> list[str]:
    """The partitions whose scheduled responses jobs call a priced API (OpenRouter)."""
    responses = {j.partition for j in jobs if j.rule in RESPONSE_RULES}
    return sorted(p for p in responses if GENERATION[inference_backend(config, p)].priced)


def _openrouter_problems(config: dict, partitions: list[str], environ: Mapping[str, str]) -> list[str]:
    settings = fill_defaults(dict(config["inference"].get("openrouter") or {}), "inference.openrouter")
    named = ", ".join(partitions)
    found = []
    variable = settings["api_key_env"]
    if not environ.get(variable):
        found.append(
            f"${variable} is not set, and the responses of {named} call OpenRouter: export {variable}=<your key> "
            "before the run (inference.openrouter.api_key_env names another variable; never put the key in a config)"
        )
    if not settings.get("model"):
        found.append(
            f"inference.openrouter.model is not set, and the responses of {named} call OpenRouter: "
            "set it to the model's OpenRouter id, e.g. moonshotai/kimi-k2.5"
        )
    return found


def _model_problems(path: str) -> list[str]:
    model = Path(path)
    if not model.is_dir():
        what = "is not a directory" if model.exists() else "does not exist"
        return [
            f"model.path {path} {what}: set model.path to the model's directory (its config.json, tokenizer "
            "files and weights), or mount it here first"
        ]
    missing = [] if (model / "config.json").is_file() else ["config.json"]
    if not any((model / name).is_file() for name in TOKENIZER_FILES):
        missing.append(" or ".join(TOKENIZER_FILES))
    if missing:
        return [
            f"model.path {path} has no {' and no '.join(missing)}: point model.path at the complete model "
            "directory (as the model's hub repository holds it)"
        ]
    return []


def chat_template_text(folder: str | Path) -> str | None:
    """The chat template a tokenizer folder holds (chat_template.jinja, else tokenizer_config.json's), as text."""
    folder = Path(folder)
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    if not (folder / "tokenizer_config.json").is_file():
        return None
    template = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
    if isinstance(template, list):  # named templates: every one
        return "\n".join(entry.get("template", "") for entry in template)
    return template


def _template_problems(folder: str | Path, model: dict) -> list[str]:
    """What the tokens and generation jobs refuse at their start (`chat.families.target_chat.load_chat`), read here
    without loading the tokenizer: a template that writes today's date without model.chat_template_date,
    a model.chat_template_kwargs key the template's text never names."""
    template = chat_template_text(folder)
    if template is None:
        return []
    found = []
    if "strftime_now" in template and model["chat_template_date"] is None:
        found.append(
            f"the chat template in {folder} writes today's date (strftime_now), so prompts rendered on another day "
            "differ from those the model saw: set model.chat_template_date (YYYY-MM-DD) to fix it"
        )
    unknown = [key for key in model["chat_template_kwargs"] if not re.search(rf"\b{re.escape(key)}\b", template)]
    if unknown:
        found.append(
            f"model.chat_template_kwargs sets {unknown}, which the chat template in {folder} never reads: use the "
            "template's own name for the switch (docs/targets.md)"
        )
    return found


def _node_env(env: str) -> tuple[str, str]:
    """The GPU node's environment for a backend's conda env name (envs/<env>-gpu.txt): its venv and how to
    get it. SGLang's is `make node-envs`' .venv-gpu; another backend's is a venv of its own from its own
    pins (`make <env>-node-env`), since its torch and transformers pins differ from SGLang's (docs/running.md)."""
    if env == "sglang":
        return ".venv-gpu", (
            "on the GPU node run the workflow from .venv-gpu (`make node-envs`, then `source .venv-gpu/bin/activate`; "
            "docs/running.md)"
        )
    venv = f".venv-{env}-gpu"
    return venv, (
        f"on the GPU node build {venv}, {env}'s pins (envs/{env}-gpu.txt) with the project (`make {env}-node-env`, "
        f"then `source {venv}/bin/activate`; docs/running.md)"
    )


def _backend_import_problems(config: dict, jobs: list[Job], environ: Mapping[str, str]) -> list[str]:
    """The launched server and the capture runner import their backend (registry entry's `imports`) in the
    job's `python` (or the interpreter `launch.command` names, or `torchrun`'s); a URL-only server is the
    user's and needs nothing here."""
    found = []
    if any(j.rule == SERVED_RESPONSE_RULE for j in jobs):
        for name in launched_backends(config):
            entry = GENERATION[name]
            launch = entry.settings(config)["launch"]
            python = _interpreter(entry.launch_command(launch, "python")[0], environ)
            if python and not _runs(python, IMPORTABLE, environ, entry.imports):
                venv, fix = _node_env(entry.env)
                found.append(
                    f"{entry.label} is not importable by {python}, which {entry.section}.launch runs "
                    f"({entry.launcher}): {fix}, run with --sdm conda (envs/{entry.env}.yaml), or set "
                    f"{entry.section}.launch.command to an interpreter that has it (e.g. [{venv}/bin/python, "
                    f"-m, {entry.launcher}])"
                )
    capture = CAPTURE[config["hidden_states"]["backend"]]
    if capture.imports and any(j.rule == "hidden_states" for j in jobs):
        # the capture runner's interpreter (stages/hidden/runner.py)
        given = config["hidden_states"]["runner"].get("python")
        runs = given or ("torchrun" if capture.tensor_parallel else "python")
        python = _interpreter(runs, environ)
        if python and not _runs(python, IMPORTABLE, environ, capture.imports):
            _, fix = _node_env(capture.env)
            found.append(
                f"{capture.label} is not importable by {python}, which runs the capture runner ({runs}) for "
                f"hidden_states.backend: {capture.name}: {fix}, run with --sdm conda (envs/{capture.env}.yaml), or "
                f"set hidden_states.runner.python to an interpreter that has {capture.imports} and the project"
            )
    return found


def _specforge_problems(config: dict, jobs: list[Job], environ: Mapping[str, str], deployed: bool) -> list[str]:
    """The evaluate jobs run scripts/evaluate.py with evaluate.python, or envs/specforge.yaml's under
    `--sdm conda` (`deployed`), which installs the CPU torch; evaluate.device: cuda needs a CUDA one."""
    if not any(j.rule in ("evaluate", "evaluate_all") for j in jobs):
        return []
    python = config["evaluate"]["python"]
    on_gpu = config["evaluate"]["device"] == "cuda"
    if deployed:
        if on_gpu:
            return [
                "evaluate.device is cuda, and --sdm conda runs the evaluate jobs in envs/specforge.yaml, whose "
                "torch is the CPU build: set evaluate.device: cpu, or run without --sdm conda with evaluate.python "
                ".venv-specforge/bin/python after `make node-envs` (SpecForge 0.2.0 on the CUDA torch)"
            ]
        return []
    if shutil.which(python, path=environ.get("PATH")) is None:
        return [
            f"evaluate.python {python} is not an interpreter here, and the evaluate jobs run SpecForge 0.2.0 "
            "with it: run `make specforge-env` (.venv-specforge, the default), set evaluate.python to a Python "
            "that has SpecForge 0.2.0, or run with --sdm conda (envs/specforge.yaml)"
        ]
    if on_gpu and not _runs(python, TORCH_BUILT_FOR_CUDA, environ):
        return [
            f"evaluate.device is cuda, and the torch of evaluate.python {python} is not a CUDA build "
            "(`make specforge-env` installs the CPU one): set evaluate.device: cpu, or evaluate.python to "
            ".venv-specforge/bin/python after `make node-envs` (SpecForge 0.2.0 on the CUDA torch)"
        ]
    return []


def _interpreter(program: str, environ: Mapping[str, str]) -> str | None:
    """The Python interpreter that `program` (found on the job's PATH) runs: itself if it is one, the one
    its `#!` line names if it is a Python script; None where that cannot be told (a shell wrapper): only
    a certain problem stops a run."""
    found = shutil.which(program, path=environ.get("PATH"))
    if found is None:
        return program
    if Path(found).name.startswith("python"):
        return found
    with open(found, "rb") as f:
        first = f.readline(512).decode(errors="replace")
    shebang = first[2:].strip().split() if first.startswith("#!") else []
    return shebang[0] if shebang and Path(shebang[0]).name.startswith("python") else None


def _runs(python: str, code: str, environ: Mapping[str, str], *args: str) -> bool:
    """Whether `python -c code args...` exits 0 in the jobs' environment."""
    try:
        return subprocess.run([python, "-c", code, *args], env=dict(environ), timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _disk_writes(config: dict, jobs: list[Job], results: Path) -> tuple[list[tuple[str, Path, int]], set[str]]:
    """(partition, output, bytes) of every shard and export `jobs` write, and of the states a one-pass
    partition's responses jobs stage until its shards are packed (counted with the shards: all of a
    partition's responses may finish before its first pack), less what each output already holds (Snakemake
    removes it before the job), counted from measured tokens, the responses' usage, bounded from the prompts
    or estimated from the source's records; and the bases used. A partition whose source cannot be read here
    is not counted."""
    writes, bases = [], set()
    # a one-pass partition's responses jobs: where each shard's states are staged (a `{shard}` pattern)
    staging = {j.partition: one_pass_states(config, j.partition) for j in jobs if j.rule in RESPONSE_RULES}
    one_pass = {partition: pattern for partition, pattern in staging.items() if pattern}
    # the states a one-pass server stages per token: the config's, the same for every partition
    staged_per_token = disk.staged_bytes_per_token(config, disk.stored_states(config)) if one_pass else 0
    partitions = {j.partition for j in jobs if j.rule in ("hidden_states", "export") and j.partition} | set(one_pass)
    for partition in sorted(partitions):
        # what a scheduled job rewrites counts for nothing: the stage above it counts instead
        rewritten = {j.rule for j in jobs if j.partition == partition}
        tokens = None if "tokens" in rewritten else disk.measured_tokens(config, partition, results)
        if tokens is None and not rewritten & set(RESPONSE_RULES):
            tokens = disk.responded_tokens(config, partition, results)
        if tokens is None and not any(j.rule == f"prompts_{prompt_partition(partition)}" for j in jobs):
            tokens = disk.bounded_tokens(config, partition, results)
        tokens = tokens or disk.estimated_tokens(config, partition)
        if tokens is None:
            continue
        bases.add(tokens.basis)
        counted = disk.partition_bytes(config, partition, tokens, results)
        shards = shard_names(config, partition)
        for job in jobs:
            if job.partition != partition:
                continue
            if job.rule in RESPONSE_RULES and partition in one_pass:
                for shard in [job.shard] if job.shard else shards:
                    out = results / Path(one_pass[partition].format(shard=shard)).relative_to("results")
                    writes.append((partition, out, tokens.tokens * staged_per_token // len(shards)))
            elif job.rule == "hidden_states":
                for shard in [job.shard] if job.shard else shards:
                    out = results / partition / "hidden" / shard
                    old = 0 if (out / RELEASED).exists() else disk.existing_bytes(out)
                    writes.append((partition, out, max(0, counted.shards // len(shards) - old)))
            elif job.rule == "export":
                for fmt in [job.format] if job.format else counted.exports:
                    out = results / partition / "export" / fmt
                    # a kept copy keeps the old export's blocks while the new one is written beside it
                    kept = (kept_export(results, partition, fmt) / "export.json").is_file()
                    old = 0 if kept else disk.existing_bytes(out)
                    writes.append((partition, out, max(0, counted.exports[fmt] - old)))
    return writes, bases


def _disk_problems(config: dict, jobs: list[Job], results: Path, environ: Mapping[str, str]) -> list[str]:
    """The bytes of the shards and exports `jobs` write, at most at once (released shards are counted: they
    are removed only once the partition's exports are done), against the room on the filesystem each goes
    to (free space, the quota tools' on the jobs' PATH, resources.disk_quota_bytes)."""
    writes, bases = _disk_writes(config, jobs, results)
    if not writes:
        return []
    found = []
    staging = {partition for partition, path, _ in writes if path.name.endswith(".states")}
    for need in disk.needs_by_filesystem(writes, results, config["resources"]["disk_quota_bytes"], dict(environ)):
        if not need.exceeded:
            continue
        bounded = any(not b.startswith(("measured", "counted")) for b in bases)
        staged = " (with the states their one-pass responses stage)" if staging & set(need.partitions) else ""
        found.append(
            f"the hidden-state shards and exports of {', '.join(need.partitions)}{staged} need up to "
            f"{need.needed / 2**30:,.1f} GiB at once ({' and '.join(sorted(bases))}), but {need.room}: free "
            "space or quota there, store them smaller (hidden_states.dtype, compress; export.specforge.compress: "
            "gzip), or put results/ on a larger disk"
            + (
                "; or run up to the tokens first (`--until tokens`): the check then counts their measured "
                "tokens instead of this count"
                if bounded
                else ""
            )
        )
    return found


def _released_problems(config: dict, jobs: list[Job], results: Path) -> list[str]:
    """Scheduled jobs on shards whose parts were released (hidden_states.keep_shards: false) that need the
    states: a capture of them (what shapes the states changed, or the tokens are made again), a probe that
    would measure otherwise than the one its released.json kept, an export its kept copy cannot give (none
    kept, or the evaluation's holdout chosen again). Each is refused with what capturing again costs. A probe
    re-judged against new thresholds and an export rebuilt from its kept copy need no state and pass."""
    found = []
    for partition in sorted({j.partition for j in jobs if j.partition}):
        hidden = results / partition / "hidden"
        released = {
            s: read_json(hidden / s / RELEASED)
            for s in shard_names(config, partition)
            if (hidden / s / RELEASED).exists()
        }
        if not released:
            continue
        why = []
        own = [j for j in jobs if j.partition == partition]
        captured = {s for j in own if j.rule == "hidden_states" for s in ([j.shard] if j.shard else released)}
        if captured & set(released):
            why.append(
                f"the hidden_states jobs of shards {', '.join(sorted(captured & set(released)))} (what shapes "
                "their states changed: the model, the layers, the tokens, the dtype or storage)"
            )
        measured_with = probe_measured_with(config["probe"], config["model"]["path"])
        probed = {s for j in own if j.rule == "probe" for s in ([j.shard] if j.shard else released)}
        remeasured = sorted(
            s
            for s in probed & set(released) - captured
            if (released[s].get("probe") or {}).get("measured_with") != measured_with
        )
        if remeasured:
            why.append(
                f"the probes of shards {', '.join(remeasured)} (they would measure otherwise than the probe "
                f"their released.json kept: {', '.join(PROBE_MEASURING)} or the model changed)"
            )
        if not captured:
            holdout_again = any(j.rule == "evaluate_holdout" for j in jobs)
            formats = sorted(
                {
                    f
                    for j in own
                    if j.rule == "export"
                    for f in ([j.format] if j.format else disk.exported_formats(config, partition))
                }
            )
            unkept = [f for f in formats if not (kept_export(results, partition, f) / "export.json").is_file()]
            if unkept:
                why.append(
                    f"the {', '.join(unkept)} export (no kept copy of it: another format is made from the states)"
                )
            if formats and holdout_again:
                why.append("the exports (the evaluation's held-out prompts are chosen again: the samples may change)")
        if why:
            tokens = sum(r["tokens"] for r in released.values())
            stored = sum(r["bytes"] for r in released.values())
            capture_rate = _capture_rate(config)
            hours = (
                f"{tokens / capture_rate / 3600:,.2f} node-hours at {capture_rate:,.0f} tokens/s"
                if capture_rate
                else "node-hours unknown (no plan.throughput.prefill_tokens_per_s)"
            )
            found.append(
                f"{partition}: {'; '.join(why)} need the hidden states, whose parts were removed once the exports "
                f"were done (hidden_states.keep_shards: false: the exports are the one copy). Capturing the "
                f"{len(released)} released shards of {hidden} again costs {tokens:,} tokens, {hours}, "
                f"{stored / 2**30:,.2f} GiB ({stored:,} bytes) written: delete {hidden} and rerun to pay it; or "
                "set back what changed (export settings, probe thresholds, the vocabulary and the rules' code "
                "below capture rerun from the kept copy without it)"
            )
    return found


def _capture_rate(config: dict) -> float | None:
    """The capture's tokens/s as the plan counts it (workflow/rates.py), None without a GPU rate."""
    try:
        states = disk.stored_states(config)
    except FileNotFoundError:
        return None
    per_token = storage.shard_bytes_per_token(
        states.dtype, states.scales, states.scale_block, states.aux_layers, states.hidden_size
    )
    rates = capture_rates(config, per_token, plan_rates(config)["prefill_tokens_per_s"]["tokens_per_s"])
    return rates["tokens_per_s"] if "gpu_tokens_per_s" in rates else None


def ledger_problems(
    config: dict,
    jobs: Iterable[Job],
    nodes: str | None,
    remote_storage: str | None,
    mountinfo: str | None = None,
) -> list[str]:
    """Where the run's ledger cannot share its limits among the scheduled responses jobs that use it (API
    ones, or any under inference.token_budget). `nodes`: why those jobs may run on several nodes (a
    cluster executor, resources.nodes > 1), None on one host; `remote_storage`: the default storage
    provider (--default-storage-provider), None without one; `mountinfo`: /proc/self/mountinfo's text
    (read here when None). On several nodes the ledger's directory must be one every job reaches, with
    locks that hold across nodes; on one host, with locks that exclude at all."""
    jobs = list(jobs)
    users = priced_partitions(config, jobs)
    if config["inference"].get("token_budget") is not None:
        users = sorted({j.partition for j in jobs if j.rule in RESPONSE_RULES and j.partition})
    if not users:
        return []
    directory = config["inference"]["ledger_dir"]
    named = ", ".join(users)
    fix = (
        "set inference.ledger_dir to a directory every node mounts with locks that hold across nodes (NFS with "
        "lockd or v4 without local_lock, Lustre mounted flock, GPFS), or run the API jobs on one host (a local "
        "executor, resources.nodes: 1)"
    )
    if nodes and remote_storage and not Path(directory).is_absolute():
        return [
            f"inference.ledger_dir={directory} is relative, and under --default-storage-provider {remote_storage} "
            f"the responses jobs of {named} ({nodes}) share no working directory: each node would keep its own "
            f"ledger, and the run's concurrency and budget would hold per node. Fix: {fix}"
        ]
    # the directory itself may not exist yet (no job has run): its nearest existing folder is on its filesystem
    existing = next(p for p in (Path(directory).absolute(), *Path(directory).absolute().parents) if p.is_dir())
    if nodes:
        mounts = ledger.parse_mountinfo(
            mountinfo if mountinfo is not None else Path("/proc/self/mountinfo").read_text()
        )
        mount = ledger.mount_of(directory, mounts)
        local = mount and ledger.node_local_locks(mount)
        if local:
            return [
                f"inference.ledger_dir={directory} is on {mount.fstype} {mount.source} ({mount.point}) mounted "
                f"{local}: its locks hold on one node only, and the responses jobs of {named} run on several "
                f"({nodes}), so none would see the others' concurrency, budget or stop. Fix: {fix}"
            ]
    if not ledger.locks_exclude(existing):
        return [
            f"inference.ledger_dir={directory}: a POSIX lock one process holds there does not keep another out, "
            f"so the responses jobs of {named} would not share their concurrency and budget. Fix: {fix}"
        ]
    return []


def raise_or_warn(found: list[str], dry_run: bool, warn, error_type=RuntimeError) -> None:
    """Stop with every problem (a real run), or print each as a warning (a dry-run)."""
    if not found:
        return
    if dry_run:
        for line in found:
            warn(f"preflight: {line}")
        return
    raise error_type("Preflight: this run would fail later; nothing has run.\n" + "\n".join(f"- {p}" for p in found))
