from eagle3_datagen import workflow as wf

PARTITIONS = sorted(config["partitions"])


wildcard_constraints:
    partition="|".join(PARTITIONS) if PARTITIONS else "NO_PARTITION",
    shard=r"\d{5}",


def get_final_output():
    return ["results/report/summary.html"]


def shards(partition):
    return wf.shard_names(config, partition)


def get_model_input(wildcards=None):
    """The demo builds its model; a production model directory is only named in params."""
    return [config["model"]["path"]] if "demo" in config else []


def get_prompt_outputs(partition):
    return expand("results/{p}/prompts/{s}.jsonl.zst", p=partition, s=shards(partition))


def get_response_settings(wildcards):
    return wf.as_json(wf.response_settings(config, wildcards.partition))


def get_token_settings(wildcards):
    return wf.as_json(wf.token_settings(config))


def get_hidden_settings(wildcards):
    return wf.as_json(wf.hidden_settings(config))


def get_conda_env(wildcards):
    """The env of the partition's inference backend's rule family."""
    backend = wf.inference_backend(config, wildcards.partition)
    return {"hf": "../envs/cpu.yaml"}.get(backend, f"../envs/{backend}.yaml")


def get_gpus(stage):
    def gpus(wildcards):
        return wf.gpus_for(config, stage, wildcards.partition)

    return gpus


def get_partition_stage_files(wildcards):
    p = wildcards.partition
    return {
        "prompt_stats": f"results/{p}/prompts/stats.json",
        "response_stats": expand(
            "results/{p}/responses/{s}.stats.json", p=p, s=shards(p)
        ),
        "audits": expand("results/{p}/tokens/{s}.audit.json", p=p, s=shards(p)),
        "hidden": expand("results/{p}/hidden/{s}", p=p, s=shards(p)),
    }
