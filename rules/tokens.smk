rule tokens:
    input:
        responses="results/{partition}/responses/{shard}.jsonl.zst",
        model=MODEL_INPUT,
    output:
        tokens="results/{partition}/tokens/{shard}.jsonl.zst",
        audit="results/{partition}/tokens/{shard}.audit.json",
    log:
        "logs/{partition}/tokens/{shard}.log",
    benchmark:
        "benchmarks/{partition}/tokens/{shard}.tsv"
    conda:
        "../envs/cpu.yaml"
    threads: 4
    resources:
        **CPU_JOB,
    params:
        settings=TOKEN_SETTINGS,
    shell:
        logged(
            "python scripts/tokens.py --responses {input.responses} --out {output.tokens} "
            "--audit {output.audit} --settings {params.settings:q} --threads {threads}",
            notes=True,
        )
