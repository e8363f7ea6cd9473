from snakemake.exceptions import WorkflowError
from snakemake.utils import min_version, validate

from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.workflow.config_errors import describe

min_version("9.0")


# config.yaml (the embedded demo) applies unless a run names its own --configfile.
if not config:

    configfile: "config.yaml"


# A config error in a few lines (key, value, what is allowed), not Snakemake's dump of the schema.
try:
    validate(config, schema="schemas/config.schema.yaml")
except WorkflowError:
    raise WorkflowError(
        describe(
            config,
            f"{workflow.basedir}/schemas/config.schema.yaml",
            workflow.overwrite_configfiles or ["config.yaml"],
        )
    ) from None
# Every setting a stage reads is now in config: validate fills defaults but those behind a $ref.
fill_defaults(config)


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
