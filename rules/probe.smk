rule probe:
    input:
        hidden="results/{partition}/hidden/{shard}",
        # what became of the shard's response rows: a shard with nothing to probe fails unless it had none
        tokens_audit="results/{partition}/tokens/{shard}.audit.json",
        model=MODEL_INPUT,
    output:
        "results/{partition}/probe/{shard}.json",
    log:
        "logs/{partition}/probe/{shard}.log",
    benchmark:
        "benchmarks/{partition}/probe/{shard}.tsv"
    conda:
        "../envs/cpu.yaml"
    threads: get_probe_threads
    resources:
        **CPU_JOB,
        mem_mb=get_probe_mem_mb,
        runtime=get_probe_runtime,
    params:
        settings=get_probe_settings,
    shell:
        logged(
            "python scripts/probe.py --hidden {input.hidden} --tokens-audit {input.tokens_audit} "
            "--partition {wildcards.partition} "
            "--out {output} --settings {params.settings:q} "
            "--threads {threads}"
        )
