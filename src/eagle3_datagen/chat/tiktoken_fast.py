"""A fast (Rust `tokenizers`) tokenizer built from a tiktoken model directory's own files.

Kimi-K2.5's model directory ships only `tiktoken.model` (BPE ranks), `tokenizer_config.json`
(its added tokens) and Moonshot's slow remote-code tokenizer. The fast tokenizer built here gives
the same IDs (checked against `tiktoken` itself in the tests) and has offset mappings.
"""

import json
from pathlib import Path

from tokenizers import AddedToken
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

# Kimi's pre-tokenizer (`pat_str` of its tokenization_kimi.py). `&&` is set intersection, read alike
# by tiktoken's fancy-regex and by tokenizers' Oniguruma.
KIMI_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
# Kimi reserves 256 IDs after the base ranks; those without a name in the config are placeholders.
NUM_RESERVED_SPECIAL = 256


def read_added_tokens(model_dir: str | Path) -> dict[int, dict]:
    return added_tokens(json.loads((Path(model_dir) / "tokenizer_config.json").read_text()))


def added_tokens(tokenizer_config: dict) -> dict[int, dict]:
    return {int(i): token for i, token in tokenizer_config.get("added_tokens_decoder", {}).items()}


def fast_tokenizer_from_tiktoken(
    model_dir: str | Path, pattern: str = KIMI_PATTERN, num_reserved: int = NUM_RESERVED_SPECIAL
) -> PreTrainedTokenizerFast:
    """The directory's `tiktoken.model` ranks plus its added tokens at their IDs, with their flags.

    IDs between the base ranks and the end of the reserved block that the config does not name
    become `<|reserved_token_{id}|>` (special), as Moonshot's tokenizer names them.
    """
    model_dir = Path(model_dir)
    backend = TikTokenConverter(vocab_file=str(model_dir / "tiktoken.model"), pattern=pattern).converted()
    base = backend.get_vocab_size()
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    added = added_tokens(config)
    for token_id in range(base, base + num_reserved):
        token = added.get(token_id, {"content": f"<|reserved_token_{token_id}|>", "special": True})
        added_token = AddedToken(token["content"], special=token["special"], normalized=False)
        # One at a time, so each token takes the next ID.
        (backend.add_special_tokens if token["special"] else backend.add_tokens)([added_token])
        if backend.token_to_id(token["content"]) != token_id:
            raise ValueError(f"{model_dir}/tokenizer_config.json: {token['content']!r} must have ID {token_id}")
    template = model_dir / "chat_template.jinja"
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=config.get("bos_token"),
        eos_token=config.get("eos_token"),
        unk_token=config.get("unk_token"),
        pad_token=config.get("pad_token"),
        chat_template=template.read_text() if template.exists() else config.get("chat_template"),
        model_max_length=config.get("model_max_length", 262144),
    )
