# One rule per partition: the number of shard outputs differs between partitions. With
# prompts.shared_across_partitions: drop, a partition also reads the prompt shards of the partitions
# before it in name order (its `earlier` input, empty with `keep`), so a change to one of them reruns
# the later ones. A glob's and a directory's files are the `source` input, a hub dataset has none: the
# script then reads the `source` in the settings.
for partition in PARTITIONS:
    earlier_shards = [
        s
        for p in parts.earlier_partitions(config, partition)
        for s in get_prompt_outputs(p)
    ]

    rule:
        name:
            f"prompts_{partition}"
        input:
            source=parts.source_inputs(config, partition),
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
        resources:
            **CPU_JOB,
        params:
            settings=wf.as_json(
                wf.prompt_settings(config, partition, SOURCE_COMMITS.get(partition))
            ),
        shell:
            logged(
                "python scripts/prompts.py --source {input.source} --earlier {input.earlier} "
                "--out {output.shards} --stats {output.stats} --settings {params.settings:q}"
            )
