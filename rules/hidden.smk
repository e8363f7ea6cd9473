rule hidden_states:
    input:
        tokens="results/{partition}/tokens/{shard}.jsonl.zst",
        model=MODEL_INPUT,
    output:
        directory("results/{partition}/hidden/{shard}"),
    log:
        "logs/{partition}/hidden/{shard}.log",
    benchmark:
        "benchmarks/{partition}/hidden/{shard}.tsv"
    group:
        CAPTURE_GROUP
    conda:
        HIDDEN_ENV
    threads: 2
    resources:
        **JOB_RESOURCES["hidden_states"],
        gpu=HIDDEN_GPUS,
    params:
        settings=HIDDEN_SETTINGS,
    shell:
        logged(
            "python scripts/hidden_states.py --tokens {input.tokens} --out {output} "
            "--settings {params.settings:q} --threads {threads}"
        )
