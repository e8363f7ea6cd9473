# One job per shard, every backend. The shard jobs of partitions that a server the workflow launches
# answers (responses_served) share one server per node (backends/service/): it is
# no job's input or output, so adding a partition or a shard reschedules no finished shard.
rule responses:
    input:
        unpack(get_response_inputs),
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
            "|".join(map(re.escape, SHARD_JOB_PARTITIONS))
            if SHARD_JOB_PARTITIONS
            else "NO_PARTITION"
        ),
    conda:
        get_conda_env
    threads: 2
    resources:
        gpu=get_response_gpus,
        runtime=get_responses_runtime,
        slurm_partition=get_response_slurm("slurm_partition"),
        qos=get_response_slurm("qos"),
        slurm_account=get_response_slurm("slurm_account"),
    params:
        settings=get_response_settings,
        server_log=SERVER_LOG,
    shell:
        logged(
            "python scripts/responses.py --prompts {input.prompts} --out {output.responses} "
            "--stats {output.stats} --server-log {params.server_log} --settings {params.settings:q} "
            "--threads {threads}"
        )


use rule responses as responses_served with:
    wildcard_constraints:
        partition=(
            "|".join(map(re.escape, SERVER_PARTITIONS))
            if SERVER_PARTITIONS
            else "NO_PARTITION"
        ),
    # Before the capture jobs that want the same GPUs: every ready shard, then the server stops.
    priority: 10
    group:
        GENERATION_GROUP
    resources:
        **JOB_RESOURCES[SERVED_RESPONSE_RULE],
        gpu=get_served_response_gpus,
