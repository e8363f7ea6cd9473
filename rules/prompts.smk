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
    # A file or directory source is the command's --source; a glob's and a hub dataset's `source` is in
    # the settings (a glob's files are the inputs, a hub dataset's commit is in the settings).
    source_option = (
        ""
        if not wf.source_is_input(config["partitions"][partition]["source"])
        else "--source {input.source} " if earlier_shards else "--source {input} "
    )

    rule:
        name:
            f"prompts_{partition}"
        input:
            source=wf.source_inputs(config, partition),
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
            settings=wf.as_json(
                wf.prompt_settings(config, partition, SOURCE_COMMITS.get(partition))
            ),
        shell:
            "python scripts/prompts.py "
            + source_option
            + ("--earlier {input.earlier} " if earlier_shards else "")
            + "--out {output.shards} --stats {output.stats} --settings {params.settings:q} > {log} 2>&1"
