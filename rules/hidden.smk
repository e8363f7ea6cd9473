rule hidden_states:
    input:
        tokens="results/{partition}/tokens/{shard}.jsonl.zst",
        model=get_model_input,
    output:
        directory("results/{partition}/hidden/{shard}"),
    log:
        "logs/{partition}/hidden/{shard}.log",
    benchmark:
        "benchmarks/{partition}/hidden/{shard}.tsv"
    conda:
        "../envs/cpu.yaml"
    threads: 2
    resources:
        gpu=get_gpus("hidden_states"),
    params:
        settings=get_hidden_settings,
    shell:
        "python scripts/hidden_states.py --tokens {input.tokens} --out {output} "
        "--settings {params.settings:q} --threads {threads} > {log} 2>&1"
