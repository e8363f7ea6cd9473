from snakemake.utils import min_version, validate

min_version("9.0")


# config.yaml (the embedded demo) applies unless a run names its own --configfile.
if not config:

    configfile: "config.yaml"


validate(config, schema="schemas/config.schema.yaml")


report: "report/workflow.rst"


include: "rules/common.smk"
include: "rules/demo.smk"
include: "rules/prompts.smk"
include: "rules/responses.smk"
include: "rules/tokens.smk"
include: "rules/hidden.smk"
include: "rules/probe.smk"
include: "rules/vocab.smk"
include: "rules/export.smk"
include: "rules/report.smk"


rule all:
    default_target: True
    input:
        get_final_output(),
