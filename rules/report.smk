rule partition_summary:
    input:
        unpack(get_partition_stage_files),
    output:
        "results/report/{partition}.json",
    log:
        "logs/{partition}/summary.log",
    conda:
        "../envs/cpu.yaml"
    shell:
        "python scripts/report.py --partition {wildcards.partition} "
        "--prompt-stats {input.prompt_stats} --response-stats {input.response_stats} "
        "--audits {input.audits} --hidden {input.hidden} --probes {input.probes} "
        "--out {output} > {log} 2>&1"


rule summary:
    input:
        expand("results/report/{partition}.json", partition=PARTITIONS),
    output:
        report(
            "results/report/summary.html",
            caption="../report/summary.rst",
            category="Summary",
        ),
    log:
        "logs/report/summary.log",
    conda:
        "../envs/cpu.yaml"
    params:
        partitions=PARTITION_SET,
    shell:
        "python scripts/report.py --combine {input} --out {output} > {log} 2>&1"
