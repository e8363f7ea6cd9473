rule vocab_mapping:
    input:
        tokens=get_all_token_shards(),
        model=MODEL_INPUT,
        # the evaluation's held-out samples are not counted, as they are not exported
        holdout=get_all_holdouts(),
    output:
        directory("results/vocab"),
    log:
        "logs/vocab/vocab_mapping.log",
    benchmark:
        "benchmarks/vocab/vocab_mapping.tsv"
    conda:
        "../envs/cpu.yaml"
    resources:
        **CPU_JOB,
        mem_mb=get_vocab_mem_mb,
        runtime=get_vocab_runtime,
    params:
        partitions=PARTITION_SET,
        # without vocab_mapping the rule is no target, and its params are never read
        draft_vocab_size=config.get("vocab_mapping", {}).get("draft_vocab_size"),
        model=get_model_path,
    shell:
        logged(
            "python scripts/vocab_mapping.py --tokens {input.tokens} --model {params.model} "
            "--draft-vocab-size {params.draft_vocab_size} --holdout {input.holdout} --out {output}"
        )
