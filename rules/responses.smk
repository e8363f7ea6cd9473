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
    conda:
        get_conda_env
    threads: 2
    resources:
        gpu=get_response_gpus,
    params:
        settings=get_response_settings,
    shell:
        "python scripts/responses.py --prompts {input.prompts} --out {output.responses} "
        "--stats {output.stats} --settings {params.settings:q} --threads {threads} > {log} 2>&1"
