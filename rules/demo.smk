if "demo" in config:

    rule build_demo_model:
        input:
            sources=[config["partitions"][p]["source"] for p in PARTITIONS],
        output:
            directory(config["model"]["path"]),
        log:
            "logs/demo/build_demo_model.log",
        benchmark:
            "benchmarks/demo/build_demo_model.tsv"
        conda:
            "../envs/cpu.yaml"
        threads: 2
        params:
            settings=wf.as_json(config["demo"]),
            sources=" ".join(
                f"--source {config['partitions'][p]['source']} {config['partitions'][p]['format']}"
                for p in PARTITIONS
            ),
        shell:
            "python scripts/build_demo_model.py {params.sources} --out {output} "
            "--settings {params.settings:q} --threads {threads} > {log} 2>&1"
