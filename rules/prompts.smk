# One rule per partition: the number of shard outputs differs between partitions.
for partition in PARTITIONS:

    rule:
        name:
            f"prompts_{partition}"
        input:
            config["partitions"][partition]["source"],
        output:
            shards=get_prompt_outputs(partition),
            stats=f"results/{partition}/prompts/stats.json",
        log:
            f"logs/{partition}/prompts.log",
        conda:
            "../envs/cpu.yaml"
        params:
            settings=wf.as_json(wf.prompt_settings(config, partition)),
        shell:
            "python scripts/prompts.py --source {input} --out {output.shards} "
            "--stats {output.stats} --settings {params.settings:q} > {log} 2>&1"
