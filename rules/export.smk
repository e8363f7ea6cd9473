rule export:
    input:
        hidden=get_partition_hidden_shards,
        model=MODEL_INPUT,
        vocab=["results/vocab"] if "vocab_mapping" in config else [],
    output:
        directory("results/{partition}/export/{format}"),
    log:
        "logs/{partition}/export/{format}.log",
    wildcard_constraints:
        format="specforge|speculators",
    conda:
        "../envs/cpu.yaml"
    params:
        model=get_model_path,
        vocab=get_vocab_option,
    shell:
        "python scripts/export.py --format {wildcards.format} --hidden {input.hidden} "
        "--model {params.model:q} {params.vocab} --out {output} > {log} 2>&1"
