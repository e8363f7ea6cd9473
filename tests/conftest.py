import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from eagle3_datagen.formats.files import iter_records

REPO = Path(__file__).resolve().parents[1]
pytest_plugins = ["tests.skip_policy", "pytester", "tests.slurm"]
WORKFLOW_FILES = [
    "Snakefile",
    "config.yaml",
    "rules",
    "scripts",
    "report",
    "profiles",
    # `--profile NAME` finds these links to profiles/NAME in the working directory.
    "gpu",
    "slurm",
    "local",
    "config",
    "resources",
    "envs",
    "Makefile",
    "pyproject.toml",
    "README.md",
]


def readme_commands() -> list[str]:
    """The commands in the README's first code block: the demo and the tests."""
    block = re.search(r"```(?:bash|sh)?\n(.*?)```", (REPO / "README.md").read_text(), re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]


def defaults(section: str, /, **settings) -> dict:
    """`settings` (of the config's section at dotted path `section`) with the schema's defaults for the
    rest, as the workflow's validated config has them."""
    from eagle3_datagen.config_schema import fill_defaults

    return fill_defaults(settings, section)


def token_settings(**settings):
    from eagle3_datagen.stages.tokens import TokenSettings

    return TokenSettings.from_config(defaults("tokens", **settings))


def probe_settings(**settings):
    from eagle3_datagen.stages.probe import ProbeSettings

    return ProbeSettings.from_config(defaults("probe", **settings))


def copy_workflow(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for name in WORKFLOW_FILES:
        src = REPO / name
        if src.is_symlink():
            (dest / name).symlink_to(src.readlink())
        elif src.is_dir():
            shutil.copytree(src, dest / name)
        else:
            shutil.copy2(src, dest / name)
    venv = Path(sys.prefix)
    (dest / ".venv").symlink_to(venv)
    # the evaluate stage's interpreter (evaluate.python); `make demo` builds it where it is missing
    if (REPO / ".venv-specforge" / ".installed").exists():
        (dest / ".venv-specforge").symlink_to(REPO / ".venv-specforge")
    return dest


# The records of each Kimi example partition's dataset (tests/fixtures/realdata), as its source.
KIMI_SOURCES = {
    "glaive-function-calling-v2.json": "glaive_function_calling_v2.jsonl",
    "magicoder-evol-instruct-110k.jsonl": "magicoder_evol_instruct_110k.jsonl",
    "magicoder-oss-instruct-75k.jsonl": "magicoder_oss_instruct_75k.jsonl",
}


def kimi_sources(work: Path) -> None:
    """The Kimi configs' sources under `work`: real records of each dataset (tests/fixtures/realdata)."""
    for name, records in KIMI_SOURCES.items():
        rows = [record for _, record in iter_records(REPO / "tests/fixtures/realdata" / records)]
        target = work / "data/raw" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(rows) if name.endswith(".json") else "".join(json.dumps(r) + "\n" for r in rows)
        target.write_text(text)


def run(cmd: list[str] | str, cwd: Path, check=True, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {}), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, shell=isinstance(cmd, str), **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def snakemake(args: list[str], cwd: Path, check=True) -> subprocess.CompletedProcess:
    return run([str(Path(sys.executable).parent / "snakemake"), *args], cwd, check=check)


def scheduled(output: str) -> list[tuple[str, str]]:
    """(rule, partition or '') of every job a verbose dry-run lists, as the plan reads them."""
    from eagle3_datagen.reporting.plan import scheduled_jobs

    return [(job.rule, job.partition or "") for job in scheduled_jobs(output)]


# Fixtures that run the workflow (or a model fit) end to end: a test that takes one is in a file marked e2e.
E2E_FIXTURES = {"demo_dir", "production_dir", "tiny_kimi_dir", "tiny_kimi_smoke"}


def pytest_addoption(parser):
    parser.addoption(
        "--slurm-first",
        action="store_true",
        help="run the files whose tests take the SLURM test cluster first (`make test`: the other run takes the "
        "machine's one cluster later, so neither waits for it)",
    )


def pytest_collection_modifyitems(config, items):
    """Each file says its tier in one line (`pytestmark = pytest.mark.e2e`); the folders tests/real_sglang
    and tests/trainers are tiers of their own. A test that takes an end-to-end fixture in a file not
    marked e2e stops the collection, naming the file and the fix, so that it never lands in the fast tier.
    The SLURM test cluster's users are marked `slurm` by the fixture they take; with --slurm-first, their
    files run first, each file's tests in their order."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & E2E_FIXTURES and not item.get_closest_marker("e2e"):
            raise pytest.UsageError(
                f"{item.nodeid} takes {', '.join(sorted(fixtures & E2E_FIXTURES))}, which runs the workflow end "
                f"to end, but {item.path.name} is not marked e2e: move the test to an e2e file, or give the file "
                "`pytestmark = pytest.mark.e2e` if all of its tests are end to end"
            )
        if "slurm_cluster" in fixtures:
            item.add_marker(pytest.mark.slurm)
        if "real_sglang" in item.path.parts:
            item.add_marker(pytest.mark.sglang)
    if config.getoption("slurm_first"):
        on_cluster = {item.path for item in items if item.get_closest_marker("slurm")}
        items.sort(key=lambda item: item.path not in on_cluster)


def leave_out_baseline(config_file: Path) -> None:
    """Rewrite a shipped config (copied into a test's workflow) with `evaluate.baseline: none`: the twins it
    ships on double the evaluate jobs of a run that does not look at them."""
    config = yaml.safe_load(config_file.read_text())
    assert config["evaluate"]["baseline"] == "original"
    config["evaluate"]["baseline"] = "none"
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))


# What the demo run printed on the console, kept beside its outputs.
DEMO_CONSOLE = "console.txt"


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> Path:
    """The embedded demo, run once with the README's own command in a copy of the workflow, without the
    baseline the demo ships on (evaluate.baseline: its twins' jobs and trainings would double the evaluate
    jobs of every test that shares this run; tests/test_baseline_workflow.py turns it on in a copy)."""
    work = copy_workflow(tmp_path_factory.mktemp("demo") / "wf")
    leave_out_baseline(work / "config.yaml")
    demo_command = readme_commands()[0]
    proc = run(demo_command, work)
    (work / DEMO_CONSOLE).write_text(proc.stdout + proc.stderr)
    return work


@pytest.fixture(scope="session")
def qwen_tokenizer():
    from eagle3_datagen.targets.demo import qwen3_tokenizer

    return qwen3_tokenizer()


KIMI_FILES = REPO / "resources" / "kimi-k2.5"
# The real tokenizer files of the other target families (README there: provenance, licences, what bites).
TARGET_FILES = REPO / "tests" / "fixtures" / "targets"
# The date the families' configs pin gpt-oss's template to (model.chat_template_date): SpecForge's harmony date.
TEMPLATE_DATE = "2025-06-28"


_target_chats: dict[str, object] = {}


def target_chat(folder: str, **model):
    """The chat of a target family's fixture folder as the stages load it (`chat.families.load_chat`),
    loaded once per test process and settings (gpt-oss's tokenizer.json takes seconds to load)."""
    from eagle3_datagen.chat.families import load_chat

    path = TARGET_FILES / folder
    settings = defaults("model", path=str(path), **{"chat_template_date": TEMPLATE_DATE, **model})
    key = json.dumps(settings, sort_keys=True)
    if key not in _target_chats:
        _target_chats[key] = load_chat(path, settings)
    return _target_chats[key]


@pytest.fixture(scope="session")
def kimi_fast():
    """Kimi-K2.5's real tokenizer as a fast tokenizer built from its files, with K2.5's template."""
    from eagle3_datagen.chat.tiktoken_fast import fast_tokenizer_from_tiktoken

    return fast_tokenizer_from_tiktoken(KIMI_FILES)


@pytest.fixture(scope="session")
def kimi_fast_dir(tmp_path_factory, kimi_fast) -> Path:
    """A model directory holding that fast tokenizer (tokenizer.json), loaded without remote code."""
    path = tmp_path_factory.mktemp("kimi-fast") / "model"
    kimi_fast.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def kimi_remote_code_dir(tmp_path_factory) -> Path:
    """A model directory laid out like a real Kimi-K2.5 one: Kimi's `tiktoken.model`, tokenizer
    config and template, and a remote-code slow tokenizer that `auto_map` names. Moonshot's own
    `tokenization_kimi.py` cannot be vendored, so the project's own tiktoken tokenizer stands in."""
    from tests.doubles.tiktoken_slow import write_remote_code_dir

    return write_remote_code_dir(KIMI_FILES, tmp_path_factory.mktemp("kimi-remote") / "model")


@pytest.fixture(scope="session")
def kimi_slow(kimi_remote_code_dir):
    from eagle3_datagen.chat.template import load_tokenizer

    return load_tokenizer(kimi_remote_code_dir, trust_remote_code=True)


def tiny_qwen3(vocab_size: int, num_layers: int = 8, **overrides):
    """A random Qwen3 of width 32 (seed it first), for tests that need a real forward pass."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=1024,
        **overrides,
    )
    return Qwen3ForCausalLM(config)


# Hidden-state settings of the shard tests: float32 states, 1 MiB parts, 64-token batches.
HIDDEN_SETTINGS = defaults("hidden_states", dtype="float32", shard_bytes=1 << 20, max_batch_tokens=64)


# A hidden-state job's settings as the workflow's rule hands them to scripts/hidden_states.py.
RUNNER_HIDDEN = defaults(
    "hidden_states", aux_layers="auto", final="raw", dtype="float32", max_batch_tokens=64, hf={"dtype": "float32"}
)


def runner_job_settings(model_dir, **hidden) -> dict:
    return {
        "model": defaults("model", path=str(model_dir)),
        "hidden_states": {
            **RUNNER_HIDDEN,
            "shard_bytes": 20_000,
            "runner": defaults("hidden_states.runner", idle_timeout=600),
            **hidden,
        },
        "tensor_parallel": 1,
        "handover": defaults("resources.handover"),
    }


def hidden_job(work, tokens, out, job_settings) -> subprocess.Popen:
    """One hidden-state job as the workflow's rule runs it (its log: `out`.log)."""
    return subprocess.Popen(
        [sys.executable, str(REPO / "scripts/hidden_states.py"), "--tokens", str(tokens), "--out", str(out),
         "--settings", json.dumps(job_settings), "--run-settings", "{}", "--threads", "1"],
        cwd=work, stderr=open(f"{out}.log", "w"), stdout=subprocess.DEVNULL,
    )  # fmt: skip


def runner_log(work) -> str:
    return (work / "logs/capture_runner/runner.log").read_text()


def make_samples(n, seed=0, lo=3, hi=40) -> list[dict]:
    """`n` token samples of random ids below 512, `lo` to `hi` long, the second half of each trained."""
    import random

    rng = random.Random(seed)
    samples = []
    for i in range(n):
        length = rng.randint(lo, hi)
        samples.append(
            {
                "id": f"s{i}",
                "input_ids": [rng.randrange(512) for _ in range(length)],
                "loss_mask": [int(k >= length // 2) for k in range(length)],
            }
        )
    return samples


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random 8-layer Qwen3 with a small vocabulary, for hidden-state tests."""
    import torch

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny") / "model"
    tiny_qwen3(512).save_pretrained(path)
    return path


def free_port() -> int:
    """A port the kernel has just handed out (a bind to port 0), for a server the test starts."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until(condition, timeout=60.0, interval=0.1) -> bool:
    """Whether `condition()` came true within `timeout` s, asked every `interval` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


# The responses backends against the loopback server (tests/doubles/loopback.py).
KEY_ENV = "E3DG_TEST_OPENROUTER_KEY"
FAST_RETRY = defaults("inference.sglang.retry", initial_backoff=0.01, max_backoff=0.05)
SAMPLING = defaults("inference.sampling", max_new_tokens=64, temperature=0.0)


@pytest.fixture
def api_key(monkeypatch):
    """The OpenRouter key the loopback server expects, in the environment variable the backend reads."""
    monkeypatch.setenv(KEY_ENV, "test-key-123")
    return "test-key-123"


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(tmp_path_factory, qwen_tokenizer) -> Path:
    """A model directory `Tiny-Model` holding Qwen3's tokenizer only: the loopback server serves no weights."""
    path = tmp_path_factory.mktemp("served") / "Tiny-Model"
    qwen_tokenizer.save_pretrained(path)
    return path


def prompts_file(tmp_path: Path, n: int, turns: int = 1, name: str = "prompts.jsonl.zst") -> Path:
    """`n` prompts of `turns` user turns each after a system prompt, ids id0000, id0001, ..."""
    from eagle3_datagen.formats.files import write_jsonl_zst

    rows = []
    for i in range(n):
        messages = [{"role": "system", "content": "Be brief."}]
        for t in range(turns):
            messages.append({"role": "user", "content": f"Question {i}.{t} about topic {i * 7 % 11}"})
        rows.append({"id": f"id{i:04d}", "source": "test", "messages": messages})
    path = tmp_path / name
    write_jsonl_zst(path, rows)
    return path


def openrouter_backend(url: str, **settings):
    from eagle3_datagen.backends.openrouter import OpenRouterBackend

    return OpenRouterBackend(
        SAMPLING,
        defaults(
            "inference.openrouter",
            base_url=url,
            model="moonshotai/kimi-k2.5",
            api_key_env=KEY_ENV,
            **{"retry": FAST_RETRY, **settings},
        ),
    )


def sglang_backend(model_dir: Path, url: str, **settings):
    from eagle3_datagen.backends.sglang.generate import SGLangBackend

    return SGLangBackend(
        model_dir, SAMPLING, defaults("inference.sglang", url=url, retry=FAST_RETRY, **settings), defaults("model")
    )


def run_responses(tmp_path: Path, prompts: Path, backend, budgets=None) -> dict:
    """The journaled responses driver on `prompts` into tmp_path/out.jsonl.zst; its stats."""
    from eagle3_datagen.stages.responses.journaled import Budgets, run_journaled_responses

    return run_journaled_responses(
        prompts, tmp_path / "out.jsonl.zst", tmp_path / "stats.json", backend, budgets or Budgets()
    )


@pytest.fixture
def node(tmp_path, monkeypatch):
    """A node directory of the test's own (jobs find it through TMPDIR); no node service left behind."""
    from eagle3_datagen.backends.service.lease import request_stop
    from eagle3_datagen.backends.service.record import node_dir, running_record

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    yield node_dir()
    request_stop()
    wait_until(lambda: running_record(node_dir()) is None, timeout=60)
