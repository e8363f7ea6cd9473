import os

from snakemake.exceptions import WorkflowError
from snakemake.logging import logger
from snakemake.settings.types import DeploymentMethod
from snakemake.utils import min_version, validate

from eagle3_datagen.backends.service.lease import request_stop
from eagle3_datagen.config_schema import SCHEMA_PATH, fill_defaults
from eagle3_datagen.workflow import canary, cluster_fit, preflight
from eagle3_datagen.workflow.config_errors import describe
from eagle3_datagen.workflow.config_checks import config_problems

min_version("9.0")


# config.yaml (the embedded demo) applies unless a run names its own --configfile.
if not config:

    configfile: "config.yaml"


# A config error in a few lines (key, value, what is allowed), not Snakemake's dump of the schema.
try:
    validate(config, schema=str(SCHEMA_PATH))
except WorkflowError:
    raise WorkflowError(
        describe(
            config,
            str(SCHEMA_PATH),
            workflow.overwrite_configfiles or ["config.yaml"],
        )
    ) from None
# Every setting a stage reads is now in config: validate fills defaults but those behind a $ref.
fill_defaults(config)

# A source that cannot be read, or settings that would delete a model the workflow did not make, or
# that no reader could take, are refused before any job. With an object store as default storage,
# the storage plugin checks its objects itself.
CONFIG_PROBLEMS = config_problems(
    config,
    workflow.overwrite_configfiles or ["config.yaml"],
    check_sources=workflow.storage_settings.default_storage_provider is None,
)
if CONFIG_PROBLEMS:
    raise WorkflowError("\n".join(CONFIG_PROBLEMS))

# With --sdm conda, each job gets its backend's env (envs/<env>.yaml: backends/plugins.py).
ENVS_DEPLOYED = DeploymentMethod.CONDA in workflow.deployment_settings.deployment_method

# A dry-run calls no onstart: it prints preflight's problems as warnings here, for every job the
# config's workflow has (a real run checks the jobs it will run, in onstart, and stops).
if workflow.output_settings.dryrun:
    preflight.raise_or_warn(
        preflight.problems(
            config,
            preflight.config_jobs(config),
            os.environ,
            ENVS_DEPLOYED,
            scheduled=False,
        ),
        dry_run=True,
        warn=logger.warning,
    )


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
include: "rules/evaluate.smk"
include: "rules/report.smk"


rule all:
    default_target: True
    input:
        get_final_output(),


onstart:
    # What would fail one of the jobs this run will run stops the run here, before its first job
    # (--touch runs no job: it only marks outputs up to date); then the canary, one request with the
    # settings of the OpenRouter responses it will ask for.
    if not workflow.touch:
        SCHEDULED = preflight.scheduled_jobs(workflow.dag)
        preflight.raise_or_warn(
            preflight.problems(config, SCHEDULED, os.environ, ENVS_DEPLOYED),
            dry_run=False,
            warn=logger.warning,
            error_type=WorkflowError,
        )
        # The API jobs' shared ledger: on a filesystem whose locks hold where the jobs run.
        preflight.raise_or_warn(
            preflight.ledger_problems(
                config,
                SCHEDULED,
                api_job_nodes(),
                workflow.storage_settings.default_storage_provider,
            ),
            dry_run=False,
            warn=logger.warning,
            error_type=WorkflowError,
        )
        preflight.raise_or_warn(
            canary.check(config, SCHEDULED, logger.info),
            dry_run=False,
            warn=logger.warning,
            error_type=WorkflowError,
        )
    # A request no node can meet, or under an account or QoS that is not the user's, fails here, before any
    # sbatch, instead of pending forever or failing with the first GPU job.
    if workflow.executor_plugin and workflow.executor_plugin.name == "slurm":
        cluster_fit.check(
            cluster_fit.scheduled_requests(workflow.dag),
            cluster_fit.read_nodes(),
            cluster_fit.read_associations(),
        )


# Where Snakemake runs on the node of a shared generation server or capture runner, the run's end stops
# it as soon as no job uses it (else it stops when idle, or with its SLURM allocation).
onsuccess:
    request_stop()


onerror:
    request_stop()
