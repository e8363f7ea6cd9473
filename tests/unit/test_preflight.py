"""Preflight: what would fail a job later stops a real run before its first job and is a warning in a
dry-run (eagle3_datagen.workflow.preflight, called by the Snakefile)."""

import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.formats.released import probe_measured_with
from eagle3_datagen.workflow import disk, preflight
from eagle3_datagen.workflow.preflight import Job, config_jobs, problems
from tests.helpers import REPO, copy_workflow, run

KIMI_SOURCES = (
    "glaive-function-calling-v2.json",
    "magicoder-evol-instruct-110k.jsonl",
    "magicoder-oss-instruct-75k.jsonl",
)
VENV_BIN = str(Path(sys.executable).parent)


def kimi(name: str = "openrouter") -> dict:
    return yaml.safe_load((REPO / f"config/kimi-k2.5-{name}.yaml").read_text())


def model_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "tokenizer_config.json").write_text("{}")
    return path


def test_the_openrouter_key_and_model_are_needed_only_when_openrouter_responses_are_scheduled(tmp_path):
    config = kimi()
    config["model"]["path"] = str(model_dir(tmp_path / "model"))
    config["hidden_states"]["backend"] = "hf"
    env = {"PATH": VENV_BIN}
    [missing] = problems(config, [Job("responses", "B1_glaive")], env, False, tmp_path / "results")
    assert missing.startswith("$OPENROUTER_API_KEY is not set, and the responses of B1_glaive call OpenRouter")
    assert "export OPENROUTER_API_KEY=" in missing
    assert problems(config, [Job("responses", "B1_glaive")], {**env, "OPENROUTER_API_KEY": "k"}, False) == []
    # the responses are done: the rest of the run needs no key
    assert problems(config, [Job("tokens", "B1_glaive"), Job("hidden_states", "B1_glaive")], env, False) == []
    config["inference"]["openrouter"].update(api_key_env="TEAM_KEY")
    del config["inference"]["openrouter"]["model"]
    found = problems(config, [Job("responses", "B3_magicoder_oss")], env, False)
    assert [line.split(",")[0] for line in found] == [
        "$TEAM_KEY is not set",
        "inference.openrouter.model is not set",
    ]
    assert "B3_magicoder_oss" in found[1] and "moonshotai/kimi-k2.5" in found[1]


def test_a_model_directory_without_config_or_tokenizer_is_named(tmp_path):
    config = kimi()
    config["hidden_states"]["backend"] = "hf"
    env = {"PATH": VENV_BIN, "OPENROUTER_API_KEY": "k"}
    jobs = [Job("tokens", "B1_glaive")]
    config["model"]["path"] = str(tmp_path / "Kimi-K2.5")
    [found] = problems(config, jobs, env, False)
    assert found.startswith(f"model.path {tmp_path / 'Kimi-K2.5'} does not exist: set model.path")
    (tmp_path / "Kimi-K2.5").mkdir()
    (tmp_path / "Kimi-K2.5" / "tiktoken.model").write_text("")
    [found] = problems(config, jobs, env, False)
    assert f"{tmp_path / 'Kimi-K2.5'} has no config.json and no tokenizer.json or tokenizer_config.json" in found
    # prompts and reports read no model; the demo builds its own
    assert problems(config, [Job("prompts_B1_glaive"), Job("summary")], env, False) == []
    demo = fill_defaults(yaml.safe_load((REPO / "config.yaml").read_text()))
    demo["evaluate"]["python"] = sys.executable  # SpecForge's venv may not be built here
    assert problems(demo, config_jobs(demo), env, False) == []


def fake_sglang(tmp_path: Path, name: str = "sglang") -> dict:
    """An importable package `name` on PYTHONPATH: a stand-in where the check only asks whether the job's
    interpreter can import it (the real SGLang and vLLM live in .venv-sglang and .venv-vllm, not every
    machine has them)."""
    (tmp_path / "site" / name).mkdir(parents=True)
    (tmp_path / "site" / name / "__init__.py").write_text("")
    return {"PYTHONPATH": str(tmp_path / "site")}


def test_sglang_must_be_importable_where_the_jobs_run_it_unless_conda_brings_it(tmp_path):
    config = fill_defaults(kimi("sglang"))
    config["model"]["path"] = str(model_dir(tmp_path / "model"))
    jobs = [Job("responses_served", "B1_glaive"), Job("hidden_states", "B1_glaive")]
    env = {"PATH": VENV_BIN}
    server, runner = problems(config, jobs, env, envs_deployed=False)
    assert server.startswith(f"SGLang is not importable by {VENV_BIN}/python, which inference.sglang.launch runs")
    assert runner.startswith(f"SGLang is not importable by {sys.executable}, which runs the capture runner (torchrun)")
    assert "--sdm conda" in server and "--sdm conda" in runner
    assert problems(config, jobs, env, envs_deployed=True) == []
    assert problems(config, jobs, {**env, **fake_sglang(tmp_path)}, envs_deployed=False) == []
    # a server the user runs (a URL, no launch) needs nothing here
    del config["inference"]["sglang"]["launch"]
    config["hidden_states"]["backend"] = "hf"
    assert problems(config, [Job("responses", "B1_glaive"), Job("hidden_states", "B1_glaive")], env, False) == []


def test_a_launched_vllm_server_and_its_capture_are_checked_by_their_registry_entries(tmp_path):
    """The same check, read from vLLM's entries: its module, its launcher, its section and its env file; a
    partition of each launched backend gets each one's line."""
    config = fill_defaults(kimi("sglang"))
    config["model"]["path"] = str(model_dir(tmp_path / "model"))
    config["inference"]["vllm"] = {"launch": fill_defaults({}, "inference.vllm.launch")}
    config["partitions"]["B3_magicoder_oss"]["backend"] = "vllm"
    config["hidden_states"]["backend"] = "vllm"
    jobs = [Job("responses_served", "B1_glaive"), Job("responses_served", "B3_magicoder_oss")]
    sglang, vllm, runner = problems(config, [*jobs, Job("hidden_states", "B1_glaive")], {"PATH": VENV_BIN}, False)
    assert sglang.startswith("SGLang is not importable") and "(envs/sglang.yaml)" in sglang
    assert vllm.startswith(f"vLLM is not importable by {VENV_BIN}/python, which inference.vllm.launch runs ")
    assert "(vllm.entrypoints.openai.api_server)" in vllm and "(envs/vllm.yaml)" in vllm
    # each backend's own node environment: SGLang's .venv-gpu holds no vLLM
    assert ".venv-gpu" in sglang and ".venv-gpu" not in vllm and ".venv-gpu" not in runner
    assert "`make vllm-node-env`" in vllm and "(envs/vllm-gpu.txt)" in vllm
    assert "[.venv-vllm-gpu/bin/python, -m," in vllm
    assert runner.startswith(f"vLLM is not importable by {VENV_BIN}/python, which runs the capture runner (python) ")
    assert "hidden_states.backend: vllm" in runner and "set hidden_states.runner.python" in runner
    # the interpreter the user names for the runner is the one checked
    config["hidden_states"]["runner"] = {"python": sys.executable}
    *_, runner = problems(config, [*jobs, Job("hidden_states", "B1_glaive")], {"PATH": VENV_BIN}, False)
    named = f"vLLM is not importable by {sys.executable}, which runs the capture runner ({sys.executable})"
    assert runner.startswith(named)
    with_vllm = {"PATH": VENV_BIN, **fake_sglang(tmp_path, "vllm")}
    assert len(problems(config, [*jobs, Job("hidden_states", "B1_glaive")], with_vllm, False)) == 1  # SGLang's


def test_the_evaluate_jobs_need_specforges_interpreter_and_a_chain_of_proposals(tmp_path):
    from eagle3_datagen.config_schema import SCHEMA_PATH
    from eagle3_datagen.workflow.config_errors import describe

    config = fill_defaults(kimi("sglang"))
    config["model"]["path"] = str(model_dir(tmp_path / "model"))
    config["evaluate"] = fill_defaults({"python": str(tmp_path / "missing/bin/python")}, "evaluate")
    jobs = [Job("evaluate", "B1_glaive")]
    (problem,) = problems(config, jobs, {"PATH": VENV_BIN}, envs_deployed=False)
    assert problem.startswith(f"evaluate.python {tmp_path}/missing/bin/python is not an interpreter here")
    assert "make specforge-env" in problem and "--sdm conda" in problem
    assert problems(config, jobs, {"PATH": VENV_BIN}, envs_deployed=True) == []  # envs/specforge.yaml
    assert problems(config, [Job("tokens", "B1_glaive")], {"PATH": VENV_BIN}, envs_deployed=False) == []
    config["evaluate"]["python"] = sys.executable
    assert problems(config, jobs, {"PATH": VENV_BIN}, envs_deployed=False) == []
    # training on a GPU with this venv's CPU torch, or with envs/specforge.yaml's under --sdm conda
    config["evaluate"]["device"] = "cuda"
    (cpu_torch,) = problems(config, jobs, {"PATH": VENV_BIN}, envs_deployed=False)
    assert cpu_torch.startswith(f"evaluate.device is cuda, and the torch of evaluate.python {sys.executable} is not")
    assert "set evaluate.device: cpu" in cpu_torch
    (conda,) = problems(config, jobs, {"PATH": VENV_BIN}, envs_deployed=True)
    assert conda.startswith("evaluate.device is cuda, and --sdm conda runs the evaluate jobs in envs/specforge.yaml")
    # a chain of proposals: the schema allows topk 1 only, and says why
    config["evaluate"]["speculative"]["topk"] = 4
    (topk,) = describe(config, SCHEMA_PATH, ["config.yaml"]).splitlines()[1:]
    assert topk.startswith("- evaluate.speculative.topk: 4 is greater than the maximum of 1 (--speculative-eagle-topk;")
    assert "decodes one chain of proposals" in topk
    config["evaluate"]["speculative"].update(topk=1, num_draft_tokens=8)  # SGLang sets num_steps + 1 at topk 1
    assert describe(config, SCHEMA_PATH, ["config.yaml"]).splitlines()[1:] == []


def write_audits(results: Path, partition: str, shards: int, tokens: int, samples: int) -> None:
    """The tokens stage's audits of a partition (their counts are what the disk check reads)."""
    for shard in range(shards):
        path = results / partition / "tokens" / f"{shard:05d}.audit.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"counts": {"tokens": tokens // shards, "samples_out": samples // shards}}))


def test_the_states_and_exports_a_run_writes_are_checked_against_the_free_disk_without_a_plan(tmp_path):
    """Measured tokens (the audits) once they exist, an upper bound from the prompts before: each output on
    the filesystem it goes to, what an output being replaced holds counted as freed."""
    from eagle3_datagen.formats.files import write_jsonl_zst

    config = fill_defaults(kimi("sglang"))
    config["model"]["path"] = str(model_dir(tmp_path / "model"))
    config["hidden_states"]["backend"] = "hf"
    results = tmp_path / "results"
    env = {"PATH": VENV_BIN}
    jobs = [Job("hidden_states", "B1_glaive"), Job("export", "B1_glaive", format="specforge")]
    assert problems(config, jobs, env, False, results) == []  # no prompts yet: nothing to count
    prompts = [{"id": f"p{i}", "messages": [{"role": "user", "content": "hi " * 50}]} for i in range(3)]
    for shard in range(16):
        write_jsonl_zst(results / "B1_glaive/prompts" / f"{shard:05d}.jsonl.zst", prompts if shard == 0 else [])
    config["inference"]["sampling"]["max_new_tokens"] = config["tokens"]["max_length"] = 10**9
    [bound] = problems(config, jobs, env, False, results)
    assert bound.startswith("the hidden-state shards and exports of B1_glaive need up to ")
    assert "(upper bound (prompts, max tokens per turn))" in bound and "--until tokens" in bound
    # 3 samples of up to 1e9 tokens (the prompts' 250 bytes and 8192-token tiers are less than the cap)
    assert re.search(r"need up to [\d,.]+ GiB", bound)
    config["inference"]["sampling"]["max_new_tokens"] = 8192
    config["tokens"]["max_length"] = 32768
    assert problems(config, jobs, env, False, results) == []  # 3 samples of at most 16,662 tokens: MiBs
    write_audits(results, "B1_glaive", 16, tokens=10**12, samples=10**6)  # the tokens stage measured them
    [measured] = problems(config, jobs, env, False, results)
    free = shutil.disk_usage(tmp_path).free / 2**30
    mount = disk.filesystem(results)[1]
    assert f"(measured (token shards)), but {free:,.1f} GiB are free on the filesystem at {mount}" in measured
    assert "--until tokens" not in measured
    # a rerun of the tokens: their measured counts are not the run's, the prompts bound it again (MiBs)
    assert problems(config, [Job("tokens", "B1_glaive"), *jobs], env, False, results) == []
    write_audits(results, "B1_glaive", 16, tokens=10**5, samples=10**2)  # 10 GiB: fits
    assert problems(config, jobs, env, False, results) == []


def test_the_disk_check_counts_each_output_on_its_own_filesystem(tmp_path):
    """An export directory on another filesystem (here /dev/shm, a tmpfs) is counted against that one's space."""
    config = fill_defaults(kimi("sglang"))
    config["model"]["path"] = str(model_dir(tmp_path / "model"))
    results = tmp_path / "results"
    write_audits(results, "B1_glaive", 16, tokens=10**5, samples=10**2)
    elsewhere = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        (results / "B1_glaive").mkdir(exist_ok=True)
        (results / "B1_glaive/export").symlink_to(elsewhere)
        jobs = [Job("hidden_states", "B1_glaive"), Job("export", "B1_glaive", format="specforge")]
        writes, bases = preflight._disk_writes(config, jobs, results)
        needs = {str(n.where): n.needed for n in disk.needs_by_filesystem(writes, results)}
        counted = disk.partition_bytes(config, "B1_glaive", disk.measured_tokens(config, "B1_glaive", results), results)
        assert needs == {
            str(disk.filesystem(results)[1]): counted.shards // 16 * 16,
            str(disk.filesystem(elsewhere)[1]): counted.exports["specforge"],
        }
        assert bases == {"measured (token shards)"}
        # a shard being captured again frees what the old one holds first
        old = results / "B1_glaive/hidden/00003"
        old.mkdir(parents=True)
        (old / "part-00000.safetensors").write_bytes(b"\0" * 1000)
        writes, _ = preflight._disk_writes(config, [Job("hidden_states", "B1_glaive", shard="00003")], results)
        assert writes == [("B1_glaive", old, counted.shards // 16 - 1000)]
    finally:
        shutil.rmtree(elsewhere)


def test_released_shards_are_captured_again_only_with_their_price_and_what_reads_them_reruns_from_the_kept_copy(
    tmp_path,
):
    """A released shard's probe with new thresholds and an export with a kept copy pass; a capture of it, a probe
    that measures otherwise and an export of a format never kept are refused, priced at plan.throughput's rate."""
    config = fill_defaults(kimi("sglang"))
    config["model"]["path"] = str(model_dir(tmp_path / "model"))
    config["hidden_states"]["backend"] = "hf"
    config["plan"]["throughput"] = {"prefill_tokens_per_s": 1000}
    results = tmp_path / "results"
    hidden = results / "B3_magicoder_oss/hidden"
    for shard in ("00000", "00001"):
        (hidden / shard).mkdir(parents=True)
    measured = probe_measured_with(config["probe"], config["model"]["path"])
    record = {"tokens": 3_600_000, "bytes": 2**30, "probe": {"measured_with": measured}}
    (hidden / "00001/released.json").write_text(json.dumps(record))
    env = {"PATH": VENV_BIN}
    export = Job("export", "B3_magicoder_oss", format="specforge")
    [found] = problems(config, [export], env, False, results)
    assert found.startswith("B3_magicoder_oss: the specforge export (no kept copy of it")
    assert (
        "3,600,000 tokens" in found
        and "1.00 GiB (1,073,741,824 bytes) written" in found
        and f"delete {hidden} and rerun" in found
    )
    (hidden / "kept/specforge").mkdir(parents=True)
    (hidden / "kept/specforge/export.json").write_text("{}")
    assert problems(config, [export], env, False, results) == []
    thresholds = {**config, "probe": {**config["probe"], "min_mean_logprob": -1.0}}
    assert problems(thresholds, [Job("probe", "B3_magicoder_oss", shard="00001")], env, False, results) == []
    reseeded = {**config, "probe": {**config["probe"], "seed": 7}}
    [found] = problems(reseeded, [Job("probe", "B3_magicoder_oss", shard="00001")], env, False, results)
    assert "the probes of shards 00001 (they would measure otherwise" in found
    capture = [Job("hidden_states", "B3_magicoder_oss", shard="00001"), export]
    [found] = problems(config, capture, env, False, results)
    rate = preflight._capture_rate(config)
    assert rate and f"{3_600_000 / rate / 3600:,.2f} node-hours at {rate:,.0f} tokens/s" in found
    assert "the hidden_states jobs of shards 00001" in found
    assert problems(config, capture, env, False, results, scheduled=False) == []  # a dry-run lists every job


@pytest.fixture(scope="module")
def kimi_workflow(tmp_path_factory) -> Path:
    """The workflow with the Kimi configs as shipped: their sources exist (empty), their model does not."""
    work = copy_workflow(tmp_path_factory.mktemp("preflight") / "wf")
    (work / "data/raw").mkdir(parents=True)
    for name in KIMI_SOURCES:
        (work / "data/raw" / name).write_text("")
    return work


def without_key(args: list[str], cwd: Path):
    """Snakemake, in an environment without the OpenRouter key."""
    saved = os.environ.pop("OPENROUTER_API_KEY", None)
    try:
        return run([str(Path(sys.executable).parent / "snakemake"), *args], cwd, check=False)
    finally:
        if saved is not None:
            os.environ["OPENROUTER_API_KEY"] = saved


def test_a_run_without_the_key_or_the_model_stops_before_any_job(kimi_workflow):
    proc = without_key(["--profile", "local", "--configfile", "config/kimi-k2.5-openrouter.yaml"], kimi_workflow)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "Preflight: this run would fail later; nothing has run." in out
    assert (
        "- $OPENROUTER_API_KEY is not set, and the responses of B1_glaive, B3_magicoder_evol, B3_magicoder_oss" in out
    )
    assert "- model.path /models/Kimi-K2.5 does not exist" in out
    assert not (kimi_workflow / "results").exists() and not (kimi_workflow / "logs").exists()


@pytest.mark.parametrize("name", ["openrouter", "sglang"])
def test_a_dry_run_warns_and_lists_the_export_that_stays(kimi_workflow, name):
    """The preview works on a laptop without the key or the model; the Kimi configs keep one copy of the
    states, SpecForge's export, once each partition's shards are released."""
    proc = without_key(["-n", "--profile", "local", "--configfile", f"config/kimi-k2.5-{name}.yaml"], kimi_workflow)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    warnings = [line for line in out.splitlines() if line.startswith("preflight: ")]
    assert "preflight: model.path /models/Kimi-K2.5 does not exist" in "\n".join(warnings)
    assert any("OPENROUTER_API_KEY" in line for line in warnings) == (name == "openrouter")
    assert re.search(r"^export\s+3$", proc.stdout, re.M)  # 3 partitions x specforge
    assert re.search(r"^release_hidden\s+3$", proc.stdout, re.M)
    assert re.search(r"^vocab_mapping\s+1$", proc.stdout, re.M)


def test_a_template_that_writes_the_date_or_a_switch_it_never_reads_stops_the_run(tmp_path):
    """Read off the real templates' text (tests/fixtures/targets), before any job loads a tokenizer."""
    env = {"PATH": VENV_BIN, "OPENROUTER_API_KEY": "k"}
    jobs = [Job("tokens", "B1_glaive")]
    config = fill_defaults(kimi())
    config["hidden_states"]["backend"] = "hf"
    config["model"]["path"] = str(REPO / "tests/fixtures/targets/gpt-oss")
    [found] = problems(config, jobs, env, False)
    assert "writes today's date (strftime_now)" in found and "set model.chat_template_date" in found
    config["model"].update(chat_template_date="2025-06-28", chat_template_kwargs={"reasoning_effort": "high"})
    assert problems(config, jobs, env, False) == []
    config["model"].update(
        path=str(REPO / "tests/fixtures/targets/deepseek-v3"), chat_template_kwargs={"enable_thinking": False}
    )
    no_config, found = problems(config, jobs, env, False)  # (the fixture folder has no config.json)
    assert found.startswith("model.chat_template_kwargs sets ['enable_thinking'], which the chat template in")
    # a target the demo builds from a tokenizer folder: that folder's template
    family = fill_defaults(yaml.safe_load((REPO / "config/targets/gpt-oss.yaml").read_text()))
    family["evaluate"]["python"] = sys.executable
    assert problems(family, config_jobs(family), env, False) == []
    family["model"]["chat_template_date"] = None
    assert any("strftime_now" in line for line in problems(family, config_jobs(family), env, False))


# /proc/self/mountinfo lines (proc(5)): the kernel documentation's own example (Documentation/filesystems/
# proc.rst), and lines written the same way from real mounts: the NFSv3 mount of apptainer/apptainer#365
# (`mount` showed it `nolock ... local_lock=all`), an NFSv4 mount with lockd's locks (local_lock=none, the
# kernel's default), PSC's Lustre /pylon5 (10.4.112.79@o2ib:/pylon5) mounted localflock and flock
# (mount.lustre(8)), and a mount point with a space (written \040).
KERNEL_EXAMPLE = "36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue"
NFS_NOLOCK = (
    "512 29 0:53 / {point} rw,relatime shared:280 - nfs mountname:/cm/shared rw,vers=3,rsize=1048576,"
    "wsize=1048576,namlen=255,hard,nolock,proto=tcp,timeo=600,retrans=2,sec=sys,mountaddr=10.197.33.254,"
    "mountvers=3,mountport=4002,mountproto=udp,local_lock=all,addr=10.197.33.254"
)
NFS4_LOCKS = (
    "610 29 0:61 / {point} rw,relatime shared:301 - nfs4 server:/export/home rw,vers=4.2,rsize=1048576,"
    "wsize=1048576,namlen=255,hard,proto=tcp,timeo=600,retrans=2,sec=sys,clientaddr=10.0.0.5,local_lock=none,"
    "addr=10.0.0.1"
)
LUSTRE = "733 29 0:75 / {point} rw,relatime shared:402 - lustre 10.4.112.79@o2ib:/pylon5 rw,{flock},lazystatfs"


def test_mount_options_whose_locks_hold_on_one_node_are_found_in_real_mountinfo_lines():
    from eagle3_datagen.backends.ledger import mount_of, node_local_locks, parse_mountinfo

    [ext3] = parse_mountinfo(KERNEL_EXAMPLE)
    assert (ext3.point, ext3.fstype, ext3.source) == ("/mnt2", "ext3", "/dev/root")
    assert ext3.options == {"rw", "noatime", "errors=continue"} and node_local_locks(ext3) is None
    mounts = parse_mountinfo(
        "\n".join(
            [
                "1 0 8:1 / / rw,relatime - ext4 /dev/sda1 rw",
                NFS_NOLOCK.format(point="/cm/shared"),
                NFS4_LOCKS.format(point="/home"),
                LUSTRE.format(point="/pylon5", flock="localflock"),
                LUSTRE.format(point="/lustre/flock", flock="flock"),
                "90 1 8:2 / /data\\040disk rw - xfs /dev/sdb1 rw",
            ]
        )
    )
    found = {m.point: node_local_locks(m) for m in mounts}
    assert found == {
        "/": None,
        "/cm/shared": "nolock",
        "/home": None,
        "/pylon5": "localflock",
        "/lustre/flock": None,
        "/data disk": None,
    }
    assert mount_of("/cm/shared/run/results/.ledger", mounts).point == "/cm/shared"
    assert mount_of("/cm/sharedx", mounts).point == "/"
    assert mount_of("/data disk/x", mounts).fstype == "xfs"
    assert node_local_locks(parse_mountinfo(NFS_NOLOCK.replace("nolock,", "").format(point="/s"))[0]) == (
        "local_lock=all"
    )


def test_a_multi_node_api_run_is_refused_where_the_ledgers_locks_hold_on_one_node(tmp_path):
    """The ledger's directory on an NFS mount with nolock, or Lustre with localflock, refuses a run whose
    API jobs span nodes, naming the fix; one host there, or this machine's real filesystem (its mountinfo
    and a lock held by another process), passes; a relative ledger_dir under remote default storage is
    refused on several nodes."""
    config = fill_defaults(kimi())
    config["inference"]["ledger_dir"] = str(tmp_path / "ledger")
    jobs = [Job("responses", "B1_glaive"), Job("responses", "B3_magicoder_oss")]
    nfs = "1 0 8:1 / / rw - ext4 /dev/sda1 rw\n" + NFS_NOLOCK.format(point=tmp_path)
    [refused] = preflight.ledger_problems(config, jobs, "executor slurm", None, nfs)
    assert refused.startswith(f"inference.ledger_dir={tmp_path}/ledger is on nfs mountname:/cm/shared ({tmp_path})")
    assert "mounted nolock: its locks hold on one node only" in refused and "B1_glaive, B3_magicoder_oss" in refused
    assert "Fix: set inference.ledger_dir to a directory every node mounts" in refused
    lustre = "1 0 8:1 / / rw - ext4 /dev/sda1 rw\n" + LUSTRE.format(point=tmp_path, flock="localflock")
    [refused] = preflight.ledger_problems(config, jobs, "resources.nodes=4", None, lustre)
    assert "lustre 10.4.112.79@o2ib:/pylon5" in refused and "mounted localflock" in refused
    assert preflight.ledger_problems(config, jobs, None, None, nfs) == []  # one host: its locks are enough
    assert preflight.ledger_problems(config, jobs, "executor slurm", None) == []  # this machine's real mounts
    assert preflight.ledger_problems(config, [Job("tokens", "B1_glaive")], "executor slurm", None, nfs) == []
    config["inference"]["ledger_dir"] = "results/.ledger"
    [remote] = preflight.ledger_problems(config, jobs, "executor slurm", "s3")
    assert "is relative, and under --default-storage-provider s3" in remote and "per node" in remote
