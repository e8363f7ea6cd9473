rule probe:
    input:
        hidden="results/{partition}/hidden/{shard}",
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
        mem_mb=get_probe_mem_mb,
        runtime=get_probe_runtime,
    params:
        settings=get_probe_settings,
    shell:
        logged(
            "python scripts/probe.py --hidden {input.hidden} --partition {wildcards.partition} "
            "--out {output} --settings {params.settings:q} "
            "--threads {threads}"
        )
