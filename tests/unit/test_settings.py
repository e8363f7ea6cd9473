"""Which config keys shape outputs and which only govern the run: the table, and what a change schedules."""

import copy
import json
import os
import sys

import pytest
import yaml

from eagle3_datagen import config_schema
from eagle3_datagen.backends.plugins import CAPTURE, DATASET, GENERATION
from eagle3_datagen.formats.service_loads import append_load
from eagle3_datagen.workflow import settings as wf
from tests.helpers import REPO, copy_workflow, scheduled, snakemake

# Every leaf key of the schema by dotted path (`*` for a partition's name), with its schema.
KEYS = config_schema.leaf_keys()
DEMO_KEYS = {k for k in KEYS if k.startswith("demo.")}


def test_every_schema_key_has_a_kind_and_the_table_names_no_other():
    unclassified = sorted(set(KEYS) - set(wf.KINDS) - DEMO_KEYS)
    assert not unclassified, f"give these an x-kind in config.schema.yaml: {unclassified}"
    assert not sorted(set(wf.KINDS) - set(KEYS)), "KINDS names keys the schema does not have"
    assert set(wf.KINDS.values()) == {wf.OUTPUT, wf.RUN}
    assert wf.kind_of("partitions.B1_glaive.shards") == wf.OUTPUT
    with pytest.raises(KeyError, match="hidden_states.new_knob"):
        wf.kind_of("hidden_states.new_knob")


def test_every_schema_key_says_its_kind_there():
    """The schema is the one table of kinds: each key has `x-kind` output or run, the demo's too."""
    missing = sorted(k for k, node in KEYS.items() if node.get("x-kind") not in (wf.OUTPUT, wf.RUN))
    assert not missing, f"give these an x-kind (output or run) in config.schema.yaml: {missing}"
    assert {k: node["x-kind"] for k, node in KEYS.items()} == wf.KINDS


SHIPPED = ["config.yaml", "config/tiny-kimi.yaml", "config/kimi-k2.5-sglang.yaml", "config/kimi-k2.5-openrouter.yaml"]


@pytest.mark.parametrize("name", SHIPPED)
def test_validated_config_holds_every_default_and_fill_alone_gives_the_same(name):
    """What the Snakefile does (Snakemake's validate, then fill_defaults) leaves no default out: every
    key with a schema default is in each object the config has, partitions and backends' retry included,
    and fill_defaults alone (scripts/plan.py) gives the same config."""
    from snakemake.utils import validate

    raw = yaml.safe_load((REPO / name).read_text())
    config = copy.deepcopy(raw)
    validate(config, str(config_schema.SCHEMA_PATH))
    assert "retry" not in config["inference"]["sglang"]  # validate does not look through a $ref
    config_schema.fill_defaults(config)
    assert config_schema.fill_defaults(copy.deepcopy(raw)) == config
    retry = {"max_attempts": 8, "initial_backoff": 1.0, "max_backoff": 60.0, "max_retry_after": 600.0}
    assert config["inference"]["sglang"]["retry"] == retry
    for key, node in KEYS.items():
        if "default" not in node:
            continue
        *parents, last = key.split(".")
        sections = [config]
        for part in parents:
            sections = [v for s in sections for v in (s.values() if part == "*" else [s.get(part)]) if v is not None]
        assert all(last in section for section in sections), f"{name}: {key} not filled"


def test_params_carry_no_run_only_setting_and_the_job_gets_both():
    config = yaml.safe_load((REPO / "config/kimi-k2.5-sglang.yaml").read_text())
    config_schema.fill_defaults(config["inference"], "inference")  # as validation fills it
    config_schema.fill_defaults(config["resources"], "resources")
    config["inference"]["token_budget"] = 10**9
    config["resources"]["handover"] = {"timeout": 120, "max_used_mib": 512}
    params = json.dumps([wf.response_settings(config, "B1_glaive"), wf.hidden_settings(config)])
    run_only_keys = ('"concurrency"', '"run_args"', '"max_batch_tokens"', '"mem_fraction_static"', '"token_budget"')
    for run_only in (*run_only_keys, '"max_failed_rate"', '"ledger_dir"'):
        assert run_only not in params
    run = wf.response_run_settings(config)
    job = wf.merged(wf.response_settings(config, "B1_glaive"), run)
    assert job["sglang"]["tiers"]["short"] == {"max_prompt_tokens": 4096, "concurrency": 256, "max_tokens": 8192}
    assert job["sglang"]["launch"]["run_args"] == ["--tp", "8"] and job["token_budget"] == 10**9
    hidden = wf.merged(wf.hidden_settings(config), wf.hidden_run_settings(config))
    assert hidden["hidden_states"]["max_batch_tokens"] == 65536 and hidden["tensor_parallel"] == 8
    # the GPU handover: run-only, both services' jobs get it
    assert job["handover"] == hidden["handover"] == {"timeout": 120, "max_used_mib": 512}
    assert hidden["hidden_states"]["sglang"] == {"mem_fraction_static": 0.8}
    with pytest.raises(KeyError, match="inference.sglang.tiers.short.typo"):
        wf.split({"tiers": {"short": {"typo": 1}}}, "inference.sglang")


# The rules each stage's change may schedule: the stage and what depends on it.
EVALUATE = {"evaluate_vocab", "evaluate", "evaluate_all", "evaluate_point", "evaluate_point_all"}
AFTER = {
    "prompts": {"prompts", "responses", "tokens", "hidden_states", "probe", "export", "vocab_mapping"}
    | {"evaluate_holdout"}
    | EVALUATE,
    "responses": {"responses", "tokens", "hidden_states", "probe", "export", "vocab_mapping"} | EVALUATE,
    "tokens": {"tokens", "hidden_states", "probe", "export", "vocab_mapping"} | EVALUATE,
    "hidden_states": {"hidden_states", "probe", "export"} | EVALUATE,
    "probe": {"probe"},
    # the exports name the draft vocabulary's size (the SpecForge draft config, the speculators command)
    "vocab_mapping": {"vocab_mapping", "export"} | EVALUATE,
    "export": {"export"} | EVALUATE,
    # the held-out prompts (evaluate.holdout, evaluate.seed) leave the exports and the vocabulary's counts
    "evaluate": {"evaluate_holdout", "vocab_mapping", "export"} | EVALUATE,
}
SUMMARIES = {"partition_summary", "summary", "all"}
DEMO_PARTITIONS = {"demo_sharegpt", "demo_openai", "demo_alpaca"}


def scope(key: str) -> tuple[str, set[str] | None]:
    """(the stage a change of `key` must schedule, the partitions it may touch; None: any)."""
    if key.startswith("demo.") or key in ("model.path", "partitions.*.format"):
        return "build_demo_model", None  # the demo model is built from these and everything reads it
    if key == "hidden_states.one_pass":
        # the vLLM partitions' responses save their states now (their requests change), and what follows
        return "responses", None
    if key.startswith("partitions."):
        return ("prompts" if key != "partitions.*.backend" else "responses"), {"demo_alpaca"}
    stage = key.split(".")[0]
    if stage == "inference":
        backend = key.split(".")[1]
        parts = {"hf": DEMO_PARTITIONS, **{name: {f"cov_{name}"} for name in GENERATION if name not in ("hf", DATASET)}}
        return "responses", parts.get(backend, DEMO_PARTITIONS if key == "inference.backend" else None)
    if stage == "model":
        return "responses", None
    return {"vocab_mapping": "vocab_mapping", "export": "export"}.get(stage, stage), None


def changed(value, schema: dict):
    """A valid value other than `value`, for a key with this schema."""
    if "enum" in schema:
        return next(v for v in schema["enum"] if v != value)
    if isinstance(value, bool):
        return not value
    if isinstance(value, int) and not isinstance(value, bool) and schema.get("type") == "integer":
        return value - 1 if value + 1 > schema.get("maximum", value + 1) else value + 1
    if isinstance(value, (int, float)):
        return 0.5 if value == 0 else value / 2
    if isinstance(value, str) and schema.get("pattern", "").startswith("^[0-9]{4}-"):  # a date
        return "2000-01-02" if value == "2000-01-01" else "2000-01-01"
    if isinstance(value, str):
        return [1, 2] if "oneOf" in schema else value + "X"  # aux_layers: auto or a list
    if isinstance(value, list):
        if "enum" in schema.get("items", {}):
            return [*value, next(v for v in schema["items"]["enum"] if v not in value)]
        return [*value, "--e3dg-changed"] if all(isinstance(v, str) for v in value) else value[:-1]
    if isinstance(value, dict):
        return {**value, "e3dg_changed": 1}
    raise TypeError(value)


# What the coverage sets itself, over config.yaml: the keys whose schema default no change can start from
# (none, null or `auto`) or that a dry-run here needs (servers named, budgets no dry-run reaches, no GPU), and
# the scenario:
# an hf partition beside the API ones, no baseline twins and one export format, so that a change adds them.
COVERAGE_VALUES = {
    "model.family": "auto",
    "model.chat_template_date": "2026-01-01",
    "model.special_tokens.expected_ids": {"<|im_end|>": 151645},
    "partitions.*.max_prompts": 1000,
    "partitions.*.backend": "hf",
    "inference.token_budget": 10**9,
    "inference.sglang.served_model": "model",
    "inference.sglang.launch.command": ["python", "-m", "sglang.launch_server"],
    "inference.sglang.launch.args": ["--trust-remote-code"],
    "inference.sglang.launch.run_args": ["--tp", "1"],
    "inference.sglang.tiers.short.max_tokens": 48,
    "inference.sglang.tiers.long.max_tokens": 48,
    "inference.vllm.served_model": "model",
    "inference.vllm.launch.command": ["python", "-m", "vllm.entrypoints.openai.api_server"],
    "inference.vllm.launch.args": ["--dtype", "float32"],
    "inference.vllm.launch.run_args": ["--tensor-parallel-size", "1"],
    "inference.vllm.max_tokens": 48,
    "inference.openrouter.model": "moonshotai/kimi-k2.5",
    "inference.openrouter.max_tokens": 48,
    "inference.openrouter.provider": {"sort": "price"},
    "inference.openrouter.max_cost_usd": 10.0,
    "hidden_states.writer_threads": 2,
    "hidden_states.sglang.device": "cpu",  # no GPU here
    "hidden_states.runner.python": "python",  # the job's own interpreter, by name on PATH
    "export.formats": ["specforge"],
    "evaluate.baseline": "none",
    "plan.model.num_layers": 8,
    "plan.model.hidden_size": 64,
    "plan.tokenizer": "resources/kimi-k2.5",
    "resources.nodes": 4,
    "resources.disk_quota_bytes": 2**50,  # a quota far above what the demo writes: run-only, checks only
    "resources.jobs.responses.api_runtime": 600,
    "resources.slurm.account": "proj",
    "resources.slurm.gpu.qos": "week",
    "resources.slurm.cpu.qos": "normal",
}


def schema_value(key: str, node: dict):
    """A valid value for a key the config leaves out: its schema default, else the least its schema allows."""
    if "default" in node:
        return copy.deepcopy(node["default"])
    if "enum" in node:
        return node["enum"][0]
    if node.get("type") == "boolean":
        return False
    if node.get("type") in ("integer", "number"):
        return node.get("minimum", node.get("maximum", 1))
    raise AssertionError(f"coverage_config has no value for {key}: give it one in COVERAGE_VALUES")


def put(config: dict, key: str, value, partition: str = "demo_alpaca") -> None:
    *parents, last = key.replace("*", partition).split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def coverage_config(hidden_backend: str) -> dict:
    """The demo with a partition on each API backend and every schema key that it can change set
    (COVERAGE_VALUES' value, else config.yaml's, else the schema's), so each can change."""
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    config["hidden_states"]["backend"] = hidden_backend
    for key, value in COVERAGE_VALUES.items():
        put(config, key, copy.deepcopy(value))
    for key, node in KEYS.items():
        settable = not key.startswith("demo.") and (key not in NOT_CHANGED_HERE or "default" in node)
        if settable and lookup(config, key) is None:
            put(config, key, schema_value(key, node))
    alpaca = config["partitions"]["demo_alpaca"]
    config["partitions"]["cov_openrouter"] = {**alpaca, "shards": 1, "backend": "openrouter"}
    config["partitions"]["cov_sglang"] = {**alpaca, "shards": 1, "backend": "sglang"}
    config["partitions"]["cov_vllm"] = {**alpaca, "shards": 1, "backend": "vllm"}
    return config


def test_the_coverage_config_sets_every_key_and_holds_to_the_schema():
    from snakemake.utils import validate

    config = coverage_config("sglang")
    validate(copy.deepcopy(config), str(config_schema.SCHEMA_PATH))
    unset = [k for k in KEYS if not k.startswith("demo.") and lookup(config, k) is None]
    assert unset == ["partitions.*.subset", "partitions.*.split", "partitions.*.revision"]  # a hub dataset's
    assert config["inference"]["sglang"]["retry"]["max_attempts"] == 8  # a default behind a $ref
    assert config["inference"]["openrouter"]["sampling"]["top_p"] == 1  # no default: the most allowed
    assert config["partitions"]["cov_sglang"]["max_bad_record_rate"] == 0


def lookup(config: dict, key: str, partition: str = "demo_alpaca"):
    node = config
    for part in key.replace("*", partition).split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def with_change(config: dict, key: str, value, partition: str = "demo_alpaca") -> dict:
    config = copy.deepcopy(config)
    *parents, last = key.replace("*", partition).split(".")
    node = config
    for part in parents:
        node = node[part]
    node[last] = value
    return config


@pytest.fixture(scope="module")
def covered(tmp_path_factory):
    """The demo widened to every key's backend, its run stood in by `snakemake --touch --forceall`:
    every output exists (empty) and Snakemake records each job's params, code, input and software env
    as a run does, which is all that its rerun triggers and a dry-run read (the demo's real run is too
    slow to repeat per capture backend, and the API backends' partitions need servers). One per
    capture backend."""
    runs = {}
    for backend in CAPTURE:
        work = copy_workflow(tmp_path_factory.mktemp(f"cover-{backend}") / "wf")
        config = coverage_config(backend)
        (work / "cover.yaml").write_text(yaml.safe_dump(config))
        listing = snakemake(["-n", "--profile", "profiles/local", "--configfile", "cover.yaml"], work).stdout
        for line in listing.splitlines():
            if line.strip().startswith("output: "):  # a group job's are indented further
                for path in line.strip().removeprefix("output: ").split(", "):
                    target = work / path
                    if "." in target.name:  # a file; directory() outputs are named without a suffix
                        target.parent.mkdir(parents=True, exist_ok=True)
                        target.touch()
                    else:
                        target.mkdir(parents=True, exist_ok=True)
        # --forceall: a touch of up-to-date outputs runs no job and records nothing
        snakemake(["--profile", "profiles/local", "--configfile", "cover.yaml", "--touch", "--forceall"], work)
        assert dry_run(work, config) == []
        runs[backend] = (work, config)
    return runs


def dry_run(work, config: dict) -> list[tuple[str, str]]:
    """The jobs `snakemake -n` schedules under `config`, in a fork of this process: Snakemake is imported
    once here, not for each of the hundred dry-runs."""
    import snakemake.cli

    (work / "changed.yaml").write_text(yaml.safe_dump(config))
    out_path = work / "dry-run.out"
    pid = os.fork()
    if pid == 0:  # the child: run Snakemake's own command line, never return into pytest
        code = 1
        try:
            os.chdir(work)
            fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.stdout = sys.stderr = open(1, "w", closefd=False)  # noqa: SIM115 - not pytest's capture
            snakemake.cli.main(["-n", "--profile", "profiles/local", "--configfile", "changed.yaml"])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        finally:
            sys.stdout.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    out = out_path.read_text()
    assert os.waitstatus_to_exitcode(status) == 0, out[-3000:]
    assert "Nothing to be done" in out or "Job stats:" in out, out[-3000:]
    assert "missing provenance" not in out, out[-3000:]  # else the params trigger has nothing to compare
    return [] if "Nothing to be done" in out else scheduled(out)


# Where a key's change cannot be made on the demo: a source is an input file (the input trigger); a
# subset, split and revision apply only to a hub dataset or a dataset directory (tests/unit/test_sources.py
# changes a hub dataset's revision).
NOT_CHANGED_HERE = {"partitions.*.source", "partitions.*.subset", "partitions.*.split", "partitions.*.revision"}
# Where the schema allows one value only: the CPU evaluation decodes a chain (topk 1).
NOT_CHANGED_HERE |= {"evaluate.speculative.topk"}


def keys_of_kind(kind: str) -> list[str]:
    # an unclassified key fails test_every_schema_key_has_a_kind_and_the_table_names_no_other
    keys = [k for k in KEYS if k not in NOT_CHANGED_HERE and (wf.OUTPUT if k in DEMO_KEYS else wf.KINDS.get(k)) == kind]
    demo = yaml.safe_load((REPO / "config.yaml").read_text())["demo"]
    return sorted(k for k in keys if not k.startswith("demo.") or lookup({"demo": demo}, k) is not None)


def capture_backend_for(key: str) -> str:
    """The covered run whose capture backend a key's change is tried on: its own section's, the resources'
    on SGLang's (GPUs, tensor parallel), the rest on hf's."""
    section = key.split(".")[1] if key.startswith("hidden_states.") else None
    return section if section in CAPTURE else "sglang" if key.startswith("resources.") else "hf"


def baseline_for(covered, key: str):
    return covered[capture_backend_for(key)]


@pytest.mark.e2e
@pytest.mark.parametrize(
    "backend", [b for b in CAPTURE if any(capture_backend_for(k) == b for k in keys_of_kind(wf.RUN))]
)
def test_changing_every_run_only_key_at_once_schedules_nothing(covered, backend):
    """One dry-run with all the run-only keys changed together: a rerun trigger that fires for one change
    fires for any set that holds it, so nothing scheduled for all at once is nothing for each alone. But
    hidden_states.keep_shards turned off adds the jobs that remove each partition's shard parts, and
    reruns nothing."""
    work, config = covered[backend]
    keys = [k for k in keys_of_kind(wf.RUN) if capture_backend_for(k) == backend]
    for key in keys:
        value = lookup(config, key)
        assert value is not None, f"coverage_config sets no value for {key}"
        config = with_change(config, key, changed(value, KEYS[key]))
    jobs = dry_run(work, config)
    expected = {("release_hidden", p) for p in config["partitions"]} if backend == "hf" else set()
    assert set(jobs) <= expected | {("all", "")} and len(jobs) == len(set(jobs)), keys


@pytest.mark.e2e
@pytest.mark.parametrize("key", keys_of_kind(wf.OUTPUT))
def test_changing_an_output_key_schedules_its_stage_and_what_depends_on_it(covered, key):
    work, config = baseline_for(covered, key)
    value = lookup(config, key)
    assert value is not None, f"coverage_config sets no value for {key}"
    jobs = dry_run(work, with_change(config, key, changed(value, KEYS[key])))
    if key == "evaluate.baseline":
        # the twins (P+original) answered from the dataset, through their exports, and every draft again
        twins = {p for _, p in jobs if p and p.endswith("+original")}
        assert twins == {f"{p}+original" for p in config["partitions"]}, jobs
        assert {r for r, p in jobs if p in twins} == {"responses", "tokens", "hidden_states", "export"}, jobs
        assert {r for r, p in jobs if p not in twins} <= EVALUATE | SUMMARIES, jobs
        return
    if key == "evaluate.fractions":
        # each point of the data curve is a job of its own: a fraction left out reruns only the report,
        # one added runs its points (a partition's and the mix's) and the report, no other draft
        assert {r for r, _ in jobs} <= SUMMARIES, jobs
        added = dry_run(work, with_change(config, key, [0.25, *value]))
        points = sorted(p for r, p in added if r.startswith("evaluate_point"))
        assert points == ["", *sorted(config["partitions"])] and {r for r, _ in added} - SUMMARIES == {
            "evaluate_point",
            "evaluate_point_all",
        }, added
        return
    if key == "evaluate.min_acceptance_length":
        # the quick fail applies to the whole's drafts alone: they rerun, no point of the data curve does
        evaluated = {(r, p) for r, p in jobs if r.startswith("evaluate")}
        assert evaluated == {("evaluate", p) for p in config["partitions"]} | {("evaluate_all", "")}, jobs
        assert {r for r, _ in jobs} - SUMMARIES == {"evaluate", "evaluate_all"}, jobs
        return
    stage, partitions = scope(key)
    # one stage, two rules: the shard jobs of launched-server partitions are responses_served
    named = {"responses_served": "responses"}
    rules = {"prompts" if r.startswith("prompts_") else named.get(r, r) for r, _ in jobs}
    if stage == "build_demo_model":
        assert "build_demo_model" in rules, jobs
        return
    assert stage in rules, jobs
    allowed = AFTER[stage] | SUMMARIES
    assert rules <= allowed, jobs
    if partitions is not None:
        # each partition's draft trains with a vocabulary of its own (evaluate_vocab): no other partition's
        # job, but its twin's (evaluate.baseline), reruns
        assert {p.removesuffix("+original") for _, p in jobs if p} <= partitions, jobs


def test_the_plan_counts_one_load_per_node_or_allocation_and_reads_measured_load_times(tmp_path):
    from eagle3_datagen.reporting.plan import ScheduledJob, plan_loads

    config = config_schema.fill_defaults(yaml.safe_load((REPO / "config/kimi-k2.5-sglang.yaml").read_text()))
    counts = (("B1_glaive", 16), ("B3_magicoder_evol", 8), ("B3_magicoder_oss", 8))
    shards = [(p, s) for p, n in counts for s in range(n)]
    jobs = [ScheduledJob(rule, p, None) for p, _ in shards for rule in ("responses_served", "hidden_states")]
    loads = plan_loads(config, jobs, tmp_path)
    once = {"loads": 1, "seconds_each": 600.0, "basis": "plan.load_seconds", "hours": 1 / 6}
    assert loads == {"generation_server": once, "capture_runner": once}  # one node: each loads once
    # Under SLURM, once per allocation: 2 group jobs of 16 shards each, and one job outside any group.
    grouped = [ScheduledJob("hidden_states", p, n // 16) for n, (p, _) in enumerate(shards)]
    grouped.append(ScheduledJob("hidden_states", "B1_glaive", None))
    assert plan_loads(config, grouped, tmp_path, per_allocation=True)["capture_runner"]["loads"] == 3
    # Load times come from the services' load records (formats/service_loads.py), one file per allocation;
    # another model's loads do not count.
    (tmp_path / "server").mkdir()
    for name, seconds, model in (("loads", 250.5, "/models/Kimi-K2.5"), ("loads.slurm-7", 239.5, "/models/Kimi-K2.5")):
        append_load(tmp_path / "server" / f"{name}.jsonl", "generation_server", model, seconds, "gpu-1")
    append_load(tmp_path / "server" / "loads.jsonl", "generation_server", "/models/Other", 10.0, "gpu-1")
    measured = plan_loads(config, jobs, tmp_path)
    assert measured["generation_server"]["seconds_each"] == pytest.approx((250.5 + 239.5) / 2)
    assert measured["generation_server"]["basis"] == "measured, mean of 2 in logs/"
    assert measured["capture_runner"] == once
    assert plan_loads(config, [ScheduledJob("tokens", "B1_glaive", None)], tmp_path)["generation_server"]["loads"] == 0


def test_the_plan_reads_load_times_from_the_load_records_not_the_log_wording(tmp_path):
    """Whatever the services' logs say (reworded, or an older wording with other numbers), the plan's load
    times are the load records'."""
    from eagle3_datagen.reporting.plan import ScheduledJob, plan_loads

    config = config_schema.fill_defaults(yaml.safe_load((REPO / "config/kimi-k2.5-sglang.yaml").read_text()))
    jobs = [ScheduledJob("hidden_states", "B1_glaive", None)]
    runner = tmp_path / "capture_runner"
    runner.mkdir()
    (runner / "runner.log").write_text("INFO __main__: capture runner ready after 999.0 s\n")
    assert plan_loads(config, jobs, tmp_path)["capture_runner"]["basis"] == "plan.load_seconds"  # no record yet
    append_load(runner / "loads.jsonl", "capture_runner", "/models/Kimi-K2.5", 321.0, "gpu-1")
    planned = plan_loads(config, jobs, tmp_path)
    (runner / "runner.log").write_text("INFO __main__: the capture runner answers now (took 5 s)\n")
    assert plan_loads(config, jobs, tmp_path) == planned
    assert planned["capture_runner"]["seconds_each"] == 321.0
