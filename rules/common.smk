# What the rules call: constants computed once per parse, input functions, `logged`. The checks before
# any job and the run's hooks are in the Snakefile.
import os
import re

from eagle3_datagen.backends.plugins import (
    CAPTURE,
    DATASET,
    GENERATION,
    SERVED_RESPONSE_RULE,
)
from eagle3_datagen.workflow import disk
from eagle3_datagen.workflow import job_resources as jr
from eagle3_datagen.workflow import partitions as parts
from eagle3_datagen.workflow import placement
from eagle3_datagen.workflow import settings as wf

PARTITIONS = sorted(config["partitions"])
# With evaluate.baseline: original, each partition P has a twin, P+original (parts.baseline_partition): P's
# prompts answered by the dataset's own turns, through tokens, hidden states and exports, which only the
# evaluate rule asks for. The final targets, the draft vocabulary and the report are the partitions' alone.
BASELINE_PARTITIONS = parts.baseline_partitions(config)
ALL_PARTITIONS = PARTITIONS + BASELINE_PARTITIONS
# Outputs that combine partitions carry the set in params, so a config that adds, drops or
# renames a partition reruns them (Snakemake's params trigger) instead of reporting up to date.
PARTITION_SET = wf.as_json(PARTITIONS)

# A hub dataset's revision, resolved to a commit from the Hugging Face cache once per parse: it is in
# the prompts rule's params, so a new commit reruns that partition only.
SOURCE_COMMITS = parts.source_commits(config)


wildcard_constraints:
    partition="|".join(map(re.escape, ALL_PARTITIONS)) if PARTITIONS else "NO_PARTITION",
    shard=r"\d{5}",


def logged(command, notes=False):
    """Every rule's `command`, its output going to the rule's log; when it fails, the log's last line (the
    script's one-line `error: ...`, or a bug's exception) is also printed on the console, beside
    Snakemake's "Error in rule". With `notes`, the log's `note: ` lines (cli.console) are printed there
    when it succeeds."""
    on_success = "&& {{ grep '^note: ' {log} >&2 || true; }}" if notes else ""
    on_failure = "|| {{ status=$?; tail -n 1 {log} >&2; exit $status; }}"
    return " ".join(filter(None, [command, "> {log} 2>&1", on_success, on_failure]))


def get_final_output():
    outputs = ["results/report/summary.html"]
    if "vocab_mapping" in config:
        outputs.append("results/vocab")
    outputs += expand(
        "results/{p}/export/{f}",
        p=PARTITIONS,
        f=config["export"]["formats"],
    )
    return outputs + EVALUATE_OUTPUTS + CURVE_OUTPUTS + RELEASED


def get_model_path(wildcards, input):
    """The model directory: the demo's as the rule's input, a production one from config."""
    return input.model if MODEL_INPUT else config["model"]["path"]


def get_partition_hidden_shards(wildcards):
    p = wildcards.partition
    return expand("results/{p}/hidden/{s}", p=p, s=shards(p))


def get_all_token_shards():
    return [s for p in PARTITIONS for s in get_token_shards(p)]


def get_token_shards(partition):
    return [f"results/{partition}/tokens/{s}.jsonl.zst" for s in shards(partition)]


def get_all_holdouts():
    if "evaluate" not in config:
        return []
    return [f"results/{p}/evaluate/holdout.json" for p in PARTITIONS]


def get_baseline_exports(wildcards):
    """The twins' SpecForge exports a draft is compared with (evaluate.baseline: original): the partition's,
    or every partition's for the draft over all (`wildcards` None)."""
    if not BASELINE_PARTITIONS:
        return []
    partitions = PARTITIONS if wildcards is None else [wildcards.partition]
    return [
        f"results/{parts.baseline_partition(p)}/export/specforge" for p in partitions
    ]


def get_evaluate_vocab(wildcards):
    """The draft vocabulary a partition's drafts train with: its own (evaluate_vocab), with vocab_mapping."""
    if "vocab_mapping" not in config:
        return []
    return [f"results/{wildcards.partition}/evaluate/vocab"]


def get_hidden_readers(wildcards):
    """What is made of a partition's shard parts (its probes and exports): the shards are released after."""
    return disk.hidden_readers(config, wildcards.partition)


# The export, probe and vocab jobs' resources, from the bytes they read (workflow/job_resources.py): Snakemake
# evaluates them again once the job's inputs exist.
def get_export_threads(wildcards, input):
    return jr.export_job(config, input.hidden, wildcards.format).threads


def get_export_mem_mb(wildcards, input, threads):
    return jr.export_job(config, input.hidden, wildcards.format, threads).mem_mb


def get_export_runtime(wildcards, input, threads):
    return jr.export_job(config, input.hidden, wildcards.format, threads).runtime


def get_probe_threads(wildcards, input):
    return jr.probe_job(config, input.hidden).threads


def get_probe_mem_mb(wildcards, input, threads):
    return jr.probe_job(config, input.hidden, threads).mem_mb


def get_probe_runtime(wildcards, input, threads):
    return jr.probe_job(config, input.hidden, threads).runtime


def get_vocab_mem_mb(wildcards, input):
    return jr.vocab_job(config, input.tokens).mem_mb


def get_vocab_runtime(wildcards, input):
    return jr.vocab_job(config, input.tokens).runtime


def get_export_settings(wildcards):
    return EXPORT_SETTINGS[wildcards.format]


def get_export_holdout(wildcards):
    """The held-out prompts an export leaves out: its prompts' partition's (a baseline twin's are its
    partition's: both drafts are measured on the same held-out samples)."""
    if "evaluate" not in config:
        return []
    return (
        f"results/{parts.prompt_partition(wildcards.partition)}/evaluate/holdout.json"
    )


def get_export_probes(wildcards):
    """The partition's probes, which its exports wait for; ancient(): a probe that reruns for its own settings
    (its thresholds) reschedules no export, since Snakemake 9 does not rerun a job whose every input from a
    rerunning job is ancient and exists. Once the partition's shards are released, not ancient: Snakemake 9.27
    then skips the export's own reasons too (a job below a rerunning one is masked, and its ancient inputs
    keep it out), so a new export setting beside a new probe threshold would leave the export stale; rebuilt
    from its kept copy, the export costs little. A baseline twin's exports have none (twins are not probed).
    """
    p = wildcards.partition
    if p not in PARTITIONS:
        return []
    probes = expand("results/{p}/probe/{s}.json", p=p, s=shards(p))
    if os.path.exists(f"results/{p}/hidden/released.json"):
        return probes
    return [ancient(f) for f in probes]


def holdout_option(wildcards, input):
    return f"--holdout {input.holdout}" if input.holdout else ""


def shards(partition):
    return parts.shard_names(config, partition)


# Per-job values are computed once here, not in an input function for each job.
# The demo builds its model; a production model directory is only named in params.
MODEL_INPUT = [config["model"]["path"]] if "demo" in config else []
TOKEN_SETTINGS = wf.as_json(wf.token_settings(config))
HIDDEN_SETTINGS = wf.as_json(wf.hidden_settings(config))
RESPONSE_SETTINGS = {
    p: wf.as_json(wf.response_settings(config, p)) for p in ALL_PARTITIONS
}
RESPONSE_GPUS = {p: placement.gpus_for(config, "responses", p) for p in ALL_PARTITIONS}
# The shard jobs of these partitions share the node's launched server (their backend's node service).
SERVER_PARTITIONS = [
    p for p in ALL_PARTITIONS if parts.served_by_launched_server(config, p)
]
SHARD_JOB_PARTITIONS = [p for p in ALL_PARTITIONS if p not in SERVER_PARTITIONS]
# The `dataset` backend's jobs read the records again: the source's files are their input too.
DATASET_SOURCES = {
    p: parts.source_inputs(config, parts.prompt_partition(p))
    for p in ALL_PARTITIONS
    if parts.inference_backend(config, p) == DATASET
}
SERVER_LOG = "logs/server/server.log"
HIDDEN_GPUS = placement.gpus_for(config, "hidden_states")
HIDDEN_ENV = f"../envs/{CAPTURE[config['hidden_states']['backend']].env}.yaml"
# Where each job goes under SLURM (resources.slurm: partition, QoS, account): a CPU job's, and per partition a
# responses job's (a GPU one's where its backend runs on the node's GPUs). Every rule asks for these; the sizes
# of jobs other than the heavy rules' below come from the profile's default-resources.
CPU_JOB = placement.slurm_resources(config, 0)
RESPONSE_SLURM = {
    p: placement.slurm_resources(config, RESPONSE_GPUS[p]) for p in ALL_PARTITIONS
}


# Under a cluster executor each GPU stage's shard jobs spread over resources.nodes nodes: its group (profiles/slurm's
# one allocation per node, one model load) takes ceil(scheduled shards / nodes) of them per group job. A group job's
# own Snakemake runs its jobs one by one, outside any group.
def gpu_group(name, rule):
    def group(wildcards):
        if workflow.remote_exec:
            return None
        placement.spread_over_nodes(workflow, name, rule, config["resources"]["nodes"])
        return name

    return group


GENERATION_GROUP = gpu_group("generation", SERVED_RESPONSE_RULE)
CAPTURE_GROUP = gpu_group("capture", "hidden_states")


# Where Snakemake runs on the node and deals out its GPUs (a `gpu` pool: profiles/gpu), a share of them; else
# (a cluster job, a run without the pool) all. Resolved when the jobs are made, once the executor is known.
def get_served_response_gpus(wildcards):
    pooled = "gpu" in (workflow.resource_settings.resources or {})
    local = not (workflow.non_local_exec or workflow.remote_exec)
    return placement.served_response_gpus(config, shared=pooled and local)


# What the heavy rules' cluster jobs ask for, their partition, QoS and account included.
JOB_RESOURCES = {
    "hidden_states": placement.cluster_job(config, "hidden_states", HIDDEN_GPUS),
    SERVED_RESPONSE_RULE: placement.cluster_job(
        config, SERVED_RESPONSE_RULE, config["resources"]["gpus_per_node"]
    ),
}
# The exporters name the draft vocabulary the workflow builds (results/vocab) and its size; the
# evaluate jobs train with it, so it is their input.
VOCAB_INPUT = ["results/vocab"] if "vocab_mapping" in config else []
VOCAB_OPTIONS = (
    f"--vocab results/vocab --draft-vocab-size {config['vocab_mapping']['draft_vocab_size']}"
    if "vocab_mapping" in config
    else ""
)
PROBE_SETTINGS = {p: wf.as_json(wf.probe_settings(config, p)) for p in PARTITIONS}
# Per format, the export settings that shape it (a change to SpecForge's compression reruns only its exports).
EXPORT_SETTINGS = {
    fmt: wf.as_json(wf.export_settings(config, fmt))
    for fmt in config["export"]["formats"]
}
# With hidden_states.keep_shards: false (the default), a partition with an export keeps only its shards'
# index.json once its exports and probes are done (`release_hidden` in rules/hidden.smk), so that the exports
# are the run's one copy of the states.
RELEASED = [
    f"results/{p}/hidden/released.json" for p in disk.released_partitions(config)
]
EVALUATE_SETTINGS = wf.evaluate_settings(config)
# evaluate.device: cuda trains each draft on one GPU of the node (run-only: a resource, not a param)
EVALUATE_GPUS = int("evaluate" in config and config["evaluate"]["device"] == "cuda")
EVALUATE_SLURM = placement.slurm_resources(config, EVALUATE_GPUS)
# Per partition, and a draft on every partition's exports together where there are several.
EVALUATE_OUTPUTS = (
    expand("results/{p}/evaluate/acceptance.json", p=PARTITIONS)
    + (["results/evaluate/acceptance.json"] if len(PARTITIONS) > 1 else [])
    if "evaluate" in config
    else []
)
# The data curve's points below the whole (evaluate.fractions): a draft each, per partition and over all.
CURVE_FRACTIONS = wf.curve_fractions(config)
CURVE_POINT_SETTINGS = wf.curve_point_settings(config)
CURVE_OUTPUTS = [
    path.replace("acceptance.json", f"curve/{fraction}.json")
    for path in EVALUATE_OUTPUTS
    for fraction in CURVE_FRACTIONS
]
# Run-only settings reach the jobs through the environment, which Snakemake's rerun triggers never
# compare (they compare params, the shell template, input paths and the software env) and which
# .snakemake/ does not record. Every process that parses this file sets it, a cluster job's too (so
# it is here, beside what the rules call: the rules' jobs inherit it); each job writes them to its log.
os.environ[wf.RUN_SETTINGS_ENV] = wf.as_json(wf.run_settings(config))
# The evaluate jobs' interpreter: SpecForge's venv (evaluate.python), or envs/specforge.yaml's under
# --sdm conda. Run-only: it reaches their shell through the environment (wf.SPECFORGE_PYTHON_ENV).
os.environ[wf.SPECFORGE_PYTHON_ENV] = (
    "python"
    if ENVS_DEPLOYED or "evaluate" not in config
    else config["evaluate"]["python"]
)


def get_prompt_outputs(partition):
    return expand("results/{p}/prompts/{s}.jsonl.zst", p=partition, s=shards(partition))


def get_one_pass_states(wildcards):
    """A one-pass partition's capture job packs the states its responses job staged (hidden_states.one_pass)."""
    states = wf.one_pass_states(config, wildcards.partition)
    return f"--states {states.format(shard=wildcards.shard)}" if states else ""


def get_response_settings(wildcards):
    return RESPONSE_SETTINGS[wildcards.partition]


def get_response_inputs(wildcards):
    """The prompt shard a responses job answers (a baseline partition's is its partition's), and the
    source the `dataset` backend reads the records' own turns from."""
    p = wildcards.partition
    inputs = {
        "prompts": f"results/{parts.prompt_partition(p)}/prompts/{wildcards.shard}.jsonl.zst"
    }
    if p in DATASET_SOURCES:
        inputs["source"] = DATASET_SOURCES[p]
    return inputs


def get_conda_env(wildcards):
    """The env of the partition's inference backend."""
    backend = GENERATION[parts.inference_backend(config, wildcards.partition)]
    return f"../envs/{backend.env}.yaml"


def get_probe_settings(wildcards):
    return PROBE_SETTINGS[wildcards.partition]


def get_response_gpus(wildcards):
    return RESPONSE_GPUS[wildcards.partition]


def get_responses_runtime(wildcards, input):
    """Minutes (resources.jobs.responses): an API job's from its shard's plan, once the shard exists."""
    return jr.responses_minutes(config, wildcards.partition, input.prompts)


def get_response_slurm(key):
    """The responses job's SLURM resource `key` (resources.slurm): GPU jobs go to the GPU partition, API
    clients and CPU work to the CPU one (None: not asked for)."""
    return lambda wildcards: RESPONSE_SLURM[wildcards.partition].get(key)


def get_partition_stage_files(wildcards):
    p = wildcards.partition
    return {
        "prompt_stats": f"results/{p}/prompts/stats.json",
        "response_stats": expand(
            "results/{p}/responses/{s}.stats.json", p=p, s=shards(p)
        ),
        "audits": expand("results/{p}/tokens/{s}.audit.json", p=p, s=shards(p)),
        "hidden": get_partition_hidden_shards(wildcards),
        "probes": expand("results/{p}/probe/{s}.json", p=p, s=shards(p)),
    }


def api_job_nodes():
    """Why the run's jobs may run on several nodes, or None."""
    executor = workflow.executor_plugin.name if workflow.executor_plugin else "local"
    if executor not in ("local", "dryrun", "touch"):
        return f"executor {executor}"
    if config["resources"]["nodes"] > 1:
        return f"resources.nodes={config['resources']['nodes']}"
    return None
