from eagle3_datagen import workflow as wf

PARTITIONS = sorted(config["partitions"])


wildcard_constraints:
    partition="|".join(PARTITIONS) if PARTITIONS else "NO_PARTITION",
    shard=r"\d{5}",


def get_final_output():
    return ["results/report/summary.html"]


def shards(partition):
    return wf.shard_names(config, partition)


# Per-job values are computed once here, not in an input function for each job.
# The demo builds its model; a production model directory is only named in params.
MODEL_INPUT = [config["model"]["path"]] if "demo" in config else []
TOKEN_SETTINGS = wf.as_json(wf.token_settings(config))
HIDDEN_SETTINGS = wf.as_json(wf.hidden_settings(config))
RESPONSE_SETTINGS = {p: wf.as_json(wf.response_settings(config, p)) for p in PARTITIONS}
RESPONSE_GPUS = {p: wf.gpus_for(config, "responses", p) for p in PARTITIONS}
HIDDEN_GPUS = wf.gpus_for(config, "hidden_states")
PROBE_SETTINGS = {p: wf.as_json(wf.probe_settings(config, p)) for p in PARTITIONS}


def get_prompt_outputs(partition):
    return expand("results/{p}/prompts/{s}.jsonl.zst", p=partition, s=shards(partition))


def get_response_settings(wildcards):
    return RESPONSE_SETTINGS[wildcards.partition]


def get_conda_env(wildcards):
    """The env of the partition's inference backend's rule family."""
    backend = wf.inference_backend(config, wildcards.partition)
    return {"hf": "../envs/cpu.yaml"}.get(backend, f"../envs/{backend}.yaml")


def get_probe_settings(wildcards):
    return PROBE_SETTINGS[wildcards.partition]


def get_response_gpus(wildcards):
    return RESPONSE_GPUS[wildcards.partition]


def get_partition_stage_files(wildcards):
    p = wildcards.partition
    return {
        "prompt_stats": f"results/{p}/prompts/stats.json",
        "response_stats": expand(
            "results/{p}/responses/{s}.stats.json", p=p, s=shards(p)
        ),
        "audits": expand("results/{p}/tokens/{s}.audit.json", p=p, s=shards(p)),
        "hidden": expand("results/{p}/hidden/{s}", p=p, s=shards(p)),
        "probes": expand("results/{p}/probe/{s}.json", p=p, s=shards(p)),
    }
