if "demo" in config:

    rule build_demo_model:
        input:
            sources=[config["partitions"][p]["source"] for p in PARTITIONS],
            # only the deepseek_v3 demo is built from a tokenizer directory
            tokenizer=config["demo"].get("tokenizer", []),
        output:
            directory(config["model"]["path"]),
        log:
            "logs/demo/build_demo_model.log",
        benchmark:
            "benchmarks/demo/build_demo_model.tsv"
        conda:
            "../envs/cpu.yaml"
        threads: 2
        resources:
            **CPU_JOB,
        params:
            settings=wf.as_json(wf.demo_settings(config)),
            partitions=wf.as_json(wf.demo_fit_partitions(config)),
        shell:
            logged(
                "python scripts/build_demo_model.py --partitions {params.partitions:q} --out {output} "
                "--settings {params.settings:q} --threads {threads}"
            )
