# One rule per partition: the number of shard outputs differs between partitions. With
# prompts.shared_across_partitions: drop, a partition also reads the prompt shards of the partitions
# before it in name order, so a change to one of them reruns the later ones. With `keep` (the default)
# the rule and its command are the ones a config written before the option gets, so that finished
# prompts are not rescheduled.
for partition in PARTITIONS:
    earlier_shards = [
        s
        for p in wf.earlier_partitions(config, partition)
        for s in get_prompt_outputs(p)
    ]

    rule:
        name:
            f"prompts_{partition}"
        input:
            source=config["partitions"][partition]["source"],
            earlier=earlier_shards,
        output:
            shards=get_prompt_outputs(partition),
            stats=f"results/{partition}/prompts/stats.json",
        log:
            f"logs/{partition}/prompts.log",
        benchmark:
            f"benchmarks/{partition}/prompts.tsv"
        conda:
            "../envs/cpu.yaml"
        params:
            settings=wf.as_json(wf.prompt_settings(config, partition)),
        shell:
            (
                logged(
                    "python scripts/prompts.py --source {input.source} --earlier {input.earlier} "
                    "--out {output.shards} --stats {output.stats} --settings {params.settings:q}"
                )
                if earlier_shards
                else logged(
                    "python scripts/prompts.py --source {input} --out {output.shards} "
                    "--stats {output.stats} --settings {params.settings:q}"
                )
            )
