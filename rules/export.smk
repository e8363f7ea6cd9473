rule export:
    input:
        hidden=get_partition_hidden_shards,
    output:
        directory("results/{partition}/export/{format}"),
    log:
        "logs/{partition}/export/{format}.log",
    wildcard_constraints:
        format="specforge|speculators",
    conda:
        "../envs/cpu.yaml"
    shell:
        "python scripts/export.py --format {wildcards.format} --hidden {input.hidden} "
        "--out {output} > {log} 2>&1"
