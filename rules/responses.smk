rule responses:
    input:
        prompts="results/{partition}/prompts/{shard}.jsonl.zst",
        model=MODEL_INPUT,
    output:
        responses="results/{partition}/responses/{shard}.jsonl.zst",
        stats="results/{partition}/responses/{shard}.stats.json",
    log:
        "logs/{partition}/responses/{shard}.log",
    benchmark:
        "benchmarks/{partition}/responses/{shard}.tsv"
    wildcard_constraints:
        partition=(
            "|".join(SHARD_JOB_PARTITIONS) if SHARD_JOB_PARTITIONS else "NO_PARTITION"
        ),
    conda:
        get_conda_env
    threads: 2
    resources:
        gpu=get_response_gpus,
        slurm_partition=get_response_slurm_partition,
    params:
        settings=get_response_settings,
    shell:
        "python scripts/responses.py --prompts {input.prompts} --out {output.responses} "
        "--stats {output.stats} --settings {params.settings:q} --threads {threads} > {log} 2>&1"


if SERVER_PARTITIONS:

    rule responses_sglang_server:
        input:
            prompts=get_server_outputs("prompts"),
            model=MODEL_INPUT,
        output:
            responses=get_server_outputs("responses"),
            stats=get_server_outputs("stats"),
        log:
            job="logs/sglang_server/responses.log",
            server="logs/sglang_server/server.log",
        benchmark:
            "benchmarks/sglang_server/responses.tsv"
        conda:
            "../envs/sglang.yaml"
        threads: 8
        resources:
            gpu=config["resources"]["gpus_per_node"],
            slurm_partition="gpu",
            mem_mb=JOB_RESOURCES["responses_sglang_server"]["mem_mb"],
            cpus_per_task=JOB_RESOURCES["responses_sglang_server"]["cpus_per_task"],
            runtime=JOB_RESOURCES["responses_sglang_server"]["runtime"],
        params:
            settings=RESPONSE_SETTINGS[SERVER_PARTITIONS[0]],
        shell:
            "python scripts/responses.py --prompts {input.prompts} --out {output.responses} "
            "--stats {output.stats} --server-log {log.server} --settings {params.settings:q} "
            "--threads {threads} > {log.job} 2>&1"
