"""Fixtures and hooks of every tier; a tier's own fixtures are in its folder's conftest.py and the plain
helpers in tests/helpers."""

import tempfile
from pathlib import Path

import pytest

from tests.helpers import KEY_ENV, tiny_qwen3, wait_until

pytest_plugins = ["tests.skip_policy", "pytester", "tests.slurm"]

# Fixtures that run the workflow (or a model fit) end to end: a test that takes one is in a file marked e2e.
E2E_FIXTURES = {"demo_dir", "demo_model", "production_dir", "tiny_kimi_dir", "tiny_kimi_smoke"}


def pytest_addoption(parser):
    parser.addoption(
        "--slurm-first",
        action="store_true",
        help="run the files whose tests take the SLURM test cluster first (`make test`: the other run takes the "
        "machine's one cluster later, so neither waits for it)",
    )


def pytest_collection_modifyitems(config, items):
    """Each file says its tier in one line (`pytestmark = pytest.mark.e2e`); the folders tests/real_sglang,
    tests/real_vllm and tests/trainers are tiers of their own. A test that takes an end-to-end fixture in a file not
    marked e2e stops the collection, naming the file and the fix, so that it never lands in the fast tier.
    The SLURM test cluster's users are marked `slurm` by the fixture they take, and the demo run's `demo` (`make
    test` runs them in a process of their own: the demo runs once a process); with --slurm-first, the SLURM
    users' files run first, each file's tests in their order."""
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
        if "demo_dir" in fixtures:
            item.add_marker(pytest.mark.demo)
        if "real_sglang" in item.path.parts:
            item.add_marker(pytest.mark.sglang)
        if "real_vllm" in item.path.parts:
            item.add_marker(pytest.mark.vllm)
    if config.getoption("slurm_first"):
        on_cluster = {item.path for item in items if item.get_closest_marker("slurm")}
        items.sort(key=lambda item: item.path not in on_cluster)


@pytest.fixture(scope="session")
def qwen_tokenizer():
    from eagle3_datagen.targets.demo import qwen3_tokenizer

    return qwen3_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random 8-layer Qwen3 with a small vocabulary, for hidden-state tests."""
    import torch

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny") / "model"
    tiny_qwen3(512).save_pretrained(path)
    return path


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
