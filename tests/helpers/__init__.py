"""What tests of several tiers share: the repository's paths, the workflow copied into a test's directory,
commands run as the workflow runs them, the schema's defaults for a section, the target fixtures and tiny
models. Plain functions and constants; the fixtures are in the conftest.py of the tiers that use them."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

from eagle3_datagen.formats.files import iter_records

REPO = Path(__file__).resolve().parents[2]

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


def leave_out_baseline(config_file: Path) -> None:
    """Rewrite a shipped config (copied into a test's workflow) with `evaluate.baseline: none`: the twins it
    ships on double the evaluate jobs of a run that does not look at them."""
    config = yaml.safe_load(config_file.read_text())
    assert config["evaluate"]["baseline"] == "original"
    config["evaluate"]["baseline"] = "none"
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))


# What the demo run printed on the console, kept beside its outputs.
DEMO_CONSOLE = "console.txt"

KIMI_FILES = REPO / "resources" / "kimi-k2.5"

# The real tokenizer files of the other target families (README there: provenance, licences, what bites).
TARGET_FILES = REPO / "tests" / "fixtures" / "targets"

# The date the families' configs pin gpt-oss's template to (model.chat_template_date): SpecForge's harmony date.
TEMPLATE_DATE = "2025-06-28"

_target_chats: dict[str, object] = {}


def target_chat(folder: str, **model):
    """The chat of a target family's fixture folder as the stages load it (`chat.families.target_chat.load_chat`),
    loaded once per test process and settings (gpt-oss's tokenizer.json takes seconds to load)."""
    from eagle3_datagen.chat.families.target_chat import load_chat

    path = TARGET_FILES / folder
    settings = defaults("model", path=str(path), **{"chat_template_date": TEMPLATE_DATE, **model})
    key = json.dumps(settings, sort_keys=True)
    if key not in _target_chats:
        _target_chats[key] = load_chat(path, settings)
    return _target_chats[key]


def tiny_qwen3(vocab_size: int, num_layers: int = 8, **overrides):
    """A random Qwen3 of width 32 (seed it first), for tests that need a real forward pass; `overrides`: other
    Qwen3Config values (a wider one)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
    }
    config = Qwen3Config(
        vocab_size=vocab_size, num_hidden_layers=num_layers, max_position_embeddings=1024, **{**shape, **overrides}
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


def free_port() -> int:
    """A port the kernel has just handed out (a bind to port 0), for a server the test starts."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until(condition, timeout=300.0, interval=0.1) -> bool:
    """Whether `condition()` came true within `timeout` s, asked every `interval` s. The timeout only bounds a
    hang: a loaded machine (a test run beside another) may take minutes to start a job's Python."""
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
