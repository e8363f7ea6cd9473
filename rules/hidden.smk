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
        states=get_one_pass_states,
    shell:
        logged(
            "python scripts/hidden_states.py --tokens {input.tokens} --out {output} "
            "--settings {params.settings:q} --threads {threads} {params.states}"
        )


# With hidden_states.keep_shards: false (the default) and an export of the partition: once its exports and
# probes are done, its shards keep index.json (and released.json) and lose their parts, so that the exports
# are the run's one copy of the states: each export is linked into hidden/kept/<format>, and released.json keeps
# what the probe measured, from which a later export or probe job reruns (stages/export/kept.py). Snakemake
# dates the shards by their .snakemake_timestamp, which stays: what was made of them stays up to date.
rule release_hidden:
    input:
        hidden=get_partition_hidden_shards,
        readers=get_hidden_readers,
    output:
        "results/{partition}/hidden/released.json",
    log:
        "logs/{partition}/hidden/released.log",
    benchmark:
        "benchmarks/{partition}/hidden/released.tsv"
    conda:
        "../envs/cpu.yaml"
    resources:
        **CPU_JOB,
    shell:
        logged(
            "python scripts/release_hidden.py --hidden {input.hidden} --after {input.readers} --out {output}"
        )
