# The exports name results/vocab's files rather than read them: one partition's change then reruns
# only its own export, not every partition's (results/vocab combines them all). A partition's export
# waits for its probes (a failed probe stops it), which are ancient() until its shards are released: a probe
# rerun for its own settings alone reschedules no export (get_export_probes). On released shards the export is
# rebuilt from its kept copy (scripts/export.py).
rule export:
    input:
        hidden=get_partition_hidden_shards,
        model=MODEL_INPUT,
        holdout=get_export_holdout,
        probes=get_export_probes,
    output:
        directory("results/{partition}/export/{format}"),
    log:
        "logs/{partition}/export/{format}.log",
    benchmark:
        "benchmarks/{partition}/export/{format}.tsv"
    wildcard_constraints:
        format="|".join(config["export"]["formats"]) or "NO_FORMAT",
    conda:
        "../envs/cpu.yaml"
    threads: get_export_threads
    resources:
        **CPU_JOB,
        mem_mb=get_export_mem_mb,
        runtime=get_export_runtime,
    params:
        model=get_model_path,
        vocab=VOCAB_OPTIONS,
        holdout=holdout_option,
        settings=get_export_settings,
    shell:
        logged(
            "python scripts/export.py --format {wildcards.format} --hidden {input.hidden} "
            "--model {params.model:q} {params.vocab} {params.holdout} --settings {params.settings:q} "
            "--threads {threads} --out {output}"
        )
