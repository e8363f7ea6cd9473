# One job per shard, every backend. Partitions that a launched SGLang server answers share one server
# per node (backends/sglang/shared.py): it is no job's input or output, so adding a partition or a
# shard reschedules no finished shard.
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
    # Before hidden-state jobs that want the same GPUs: the shared server is loaded once.
    priority: 10
    conda:
        get_conda_env
    threads: 2
    resources:
        gpu=get_response_gpus,
        slurm_partition=get_response_slurm_partition,
        mem_mb=get_response_resource("mem_mb"),
        cpus_per_task=get_response_resource("cpus_per_task"),
        runtime=get_response_resource("runtime"),
    params:
        settings=get_response_settings,
        server_log=SERVER_LOG,
    shell:
        "python scripts/responses.py --prompts {input.prompts} --out {output.responses} "
        "--stats {output.stats} --server-log {params.server_log} --settings {params.settings:q} "
        "--threads {threads} > {log} 2>&1"
