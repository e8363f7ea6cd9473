# With an `evaluate` section: per partition, held-out prompts left out of its exports, and a draft trained
# on its SpecForge export (and one on every partition's together) measured on them. scripts/evaluate.py
# runs in SpecForge's venv: `make specforge-env` (evaluate.python), or envs/specforge.yaml with --sdm conda.
rule evaluate_holdout:
    input:
        lambda wildcards: get_prompt_outputs(wildcards.partition),
    output:
        "results/{partition}/evaluate/holdout.json",
    log:
        "logs/{partition}/evaluate/holdout.log",
    benchmark:
        "benchmarks/{partition}/evaluate/holdout.tsv"
    conda:
        "../envs/cpu.yaml"
    resources:
        **CPU_JOB,
    params:
        holdout=EVALUATE_SETTINGS.get("holdout"),
        seed=EVALUATE_SETTINGS.get("seed"),
    shell:
        logged(
            "python scripts/holdout.py --prompts {input} --count {params.holdout} "
            "--seed {params.seed} --out {output}"
        )


# With evaluate.baseline: original the same draft is also trained on the export of the partition's twin
# (parts.baseline_partition: the dataset's own responses) and measured on the same held-out samples.
rule evaluate:
    input:
        export="results/{partition}/export/specforge",
        tokens=lambda wildcards: get_token_shards(wildcards.partition),
        holdout="results/{partition}/evaluate/holdout.json",
        baseline=get_baseline_exports,
        # the partition's own draft vocabulary (rules/vocab.smk: evaluate_vocab)
        vocab=get_evaluate_vocab,
    output:
        figures="results/{partition}/evaluate/acceptance.json",
        draft=directory("results/{partition}/evaluate/draft"),
    log:
        "logs/{partition}/evaluate/evaluate.log",
    benchmark:
        "benchmarks/{partition}/evaluate/evaluate.tsv"
    conda:
        "../envs/specforge.yaml"
    resources:
        **EVALUATE_SLURM,
        gpu=EVALUATE_GPUS,
    params:
        name=lambda wildcards: wildcards.partition,
        settings=wf.as_json(EVALUATE_SETTINGS),
    shell:
        logged(
            f"${wf.SPECFORGE_PYTHON_ENV} scripts/evaluate.py --partition {{params.name}} "
            "--export {input.export} --tokens {input.tokens} --holdout {input.holdout} "
            "--baseline-export {input.baseline} --vocab {input.vocab} --settings {params.settings:q} --draft {output.draft} --out {output.figures}"
        )


use rule evaluate as evaluate_all with:
    input:
        export=expand("results/{p}/export/specforge", p=PARTITIONS),
        tokens=get_all_token_shards(),
        holdout=get_all_holdouts(),
        baseline=get_baseline_exports(None),
        # the draft vocabulary the exports name (their specforge.yaml's vocab_mapping_path)
        vocab=VOCAB_INPUT,
    output:
        figures="results/evaluate/acceptance.json",
        draft=directory("results/evaluate/draft"),
    log:
        "logs/evaluate/evaluate.log",
    benchmark:
        "benchmarks/evaluate/evaluate.tsv"
    params:
        name="all",
        settings=wf.as_json(EVALUATE_SETTINGS),
        partitions=PARTITION_SET,


# The data curve (evaluate.fractions): the same drafts trained on a nested fraction of the samples, measured on
# the same held-out prompts with the same vocabulary; one job per point, so adding a fraction runs only it. No
# quick fail applies to a point, so evaluate.min_acceptance_length is not in its settings (it reruns none).
rule evaluate_point:
    input:
        export="results/{partition}/export/specforge",
        tokens=lambda wildcards: get_token_shards(wildcards.partition),
        holdout="results/{partition}/evaluate/holdout.json",
        baseline=get_baseline_exports,
        vocab=get_evaluate_vocab,
    output:
        "results/{partition}/evaluate/curve/{fraction}.json",
    log:
        "logs/{partition}/evaluate/curve/{fraction}.log",
    benchmark:
        "benchmarks/{partition}/evaluate/curve/{fraction}.tsv"
    wildcard_constraints:
        fraction=r"0\.\d+",
    conda:
        "../envs/specforge.yaml"
    resources:
        **EVALUATE_SLURM,
        gpu=EVALUATE_GPUS,
    params:
        name=lambda wildcards: wildcards.partition,
        settings=wf.as_json(CURVE_POINT_SETTINGS),
    shell:
        logged(
            f"${wf.SPECFORGE_PYTHON_ENV} scripts/evaluate.py --partition {{params.name}} "
            "--export {input.export} --tokens {input.tokens} --holdout {input.holdout} "
            "--baseline-export {input.baseline} --vocab {input.vocab} --settings {params.settings:q} "
            "--fraction {wildcards.fraction} --out {output}"
        )


use rule evaluate_point as evaluate_point_all with:
    input:
        export=expand("results/{p}/export/specforge", p=PARTITIONS),
        tokens=get_all_token_shards(),
        holdout=get_all_holdouts(),
        baseline=get_baseline_exports(None),
        vocab=VOCAB_INPUT,
    output:
        "results/evaluate/curve/{fraction}.json",
    log:
        "logs/evaluate/curve/{fraction}.log",
    benchmark:
        "benchmarks/evaluate/curve/{fraction}.tsv"
    params:
        name="all",
        settings=wf.as_json(CURVE_POINT_SETTINGS),
        partitions=PARTITION_SET,
