rule partition_summary:
    input:
        unpack(get_partition_stage_files),
    output:
        "results/report/{partition}.json",
    log:
        "logs/{partition}/summary.log",
    benchmark:
        "benchmarks/{partition}/summary.tsv"
    conda:
        "../envs/cpu.yaml"
    resources:
        **CPU_JOB,
    shell:
        logged(
            "python scripts/partition_summary.py --partition {wildcards.partition} "
            "--prompt-stats {input.prompt_stats} --response-stats {input.response_stats} "
            "--audits {input.audits} --hidden {input.hidden} --probes {input.probes} "
            "--out {output}"
        )


rule summary:
    input:
        summaries=expand("results/report/{partition}.json", partition=PARTITIONS),
        # to count the prompts partitions share (same content id)
        prompt_shards=[s for p in PARTITIONS for s in get_prompt_outputs(p)],
        # the evaluation's figures (results/*/evaluate/acceptance.json), with an `evaluate` section
        acceptance=EVALUATE_OUTPUTS,
        # the data curve's smaller drafts (evaluate.fractions)
        curve=CURVE_OUTPUTS,
    output:
        page=report(
            "results/report/summary.html",
            caption="../report/summary.rst",
            category="Summary",
        ),
        # each data curve's fit, its extrapolation and price (reporting/curve.py)
        curves="results/report/curves.json",
    log:
        "logs/report/summary.log",
    benchmark:
        "benchmarks/report/summary.tsv"
    conda:
        "../envs/cpu.yaml"
    resources:
        **CPU_JOB,
    params:
        partitions=PARTITION_SET,
        # how many of the prompt shards, in order, are each partition's
        shard_counts=wf.as_json([[p, len(get_prompt_outputs(p))] for p in PARTITIONS]),
        # read where it exists (scripts/plan.py writes it before a run): the price of more data
        plan=preflight.PLAN_FILE,
    shell:
        logged(
            "python scripts/summary.py --summaries {input.summaries} --prompt-shards {input.prompt_shards} "
            "--shard-counts {params.shard_counts:q} --evaluations {input.acceptance} "
            "--curve-points {input.curve} --plan {params.plan} --out {output.page} --curves-out {output.curves}",
            notes=True,
        )
