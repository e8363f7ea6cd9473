"""The unit tier's fixtures: Kimi-K2.5's tokenizer, loaded each way it is shipped."""

from pathlib import Path

import pytest

from tests.helpers import KIMI_FILES


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
