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


# With an `evaluate` section, each partition's draft trains with a draft vocabulary of its own samples (its
# held-out ones left out): results/vocab combines every partition, so a change to one would rerun every
# partition's evaluation. The exports the users train on, and the draft over all partitions, keep results/vocab.
use rule vocab_mapping as evaluate_vocab with:
    input:
        tokens=lambda wildcards: get_token_shards(wildcards.partition),
        model=MODEL_INPUT,
        holdout="results/{partition}/evaluate/holdout.json",
    output:
        directory("results/{partition}/evaluate/vocab"),
    log:
        "logs/{partition}/evaluate/vocab.log",
    benchmark:
        "benchmarks/{partition}/evaluate/vocab.tsv"
    params:
        draft_vocab_size=config.get("vocab_mapping", {}).get("draft_vocab_size"),
        model=get_model_path,
