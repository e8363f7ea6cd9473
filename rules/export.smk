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
    params:
        vocab=(
            f"--vocab results/vocab --draft-vocab-size {config['vocab_mapping']['draft_vocab_size']}"
            if "vocab_mapping" in config
            else ""
        ),
        model=config["model"]["path"],
    shell:
        "python scripts/export.py --format {wildcards.format} --hidden {input.hidden} "
        "--out {output} {params.vocab} --model {params.model:q} > {log} 2>&1"
