"""A slow (Python) transformers tokenizer over `tiktoken`, loaded as a model directory's remote code.

The project's own stand-in for the remote-code `TikTokenTokenizer` that a real Kimi model
directory ships (Moonshot's code is not vendored). `write_remote_code_dir` lays a directory out
like Kimi-K2.5's: its `tiktoken.model`, template and tokenizer config, with `auto_map` naming this
file copied beside them as `tokenization_tiktoken.py`, so `AutoTokenizer.from_pretrained(dir,
trust_remote_code=True)` loads a slow tokenizer (no offset mapping) whose IDs are tiktoken's. Like
Moonshot's, the 256 IDs after the base ranks are the config's named added tokens, each with its
`special` flag, and `<|reserved_token_{id}|>` for the rest. Tool declarations are left to the chat
template (its JSON form): no TypeScript rendering here.
"""

import json
import shutil
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from tokenizers import AddedToken
from transformers import PreTrainedTokenizer

from eagle3_datagen.chat.tiktoken_fast import KIMI_PATTERN, NUM_RESERVED_SPECIAL


class TiktokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, pattern=KIMI_PATTERN, added_tokens_decoder=None, **kwargs):
        self.vocab_file = vocab_file
        ranks = load_tiktoken_bpe(vocab_file)
        # Token strings are the token's bytes read as Latin-1: one character per byte, reversible.
        self._id_to_token = {rank: piece.decode("latin-1") for piece, rank in ranks.items()}
        self._token_to_id = {token: rank for rank, token in self._id_to_token.items()}
        added = {
            int(i): t if isinstance(t, AddedToken) else AddedToken(**t) for i, t in (added_tokens_decoder or {}).items()
        }
        for token_id in range(len(ranks), len(ranks) + NUM_RESERVED_SPECIAL):
            added.setdefault(token_id, AddedToken(f"<|reserved_token_{token_id}|>", special=True, normalized=False))
        self._model = tiktoken.Encoding(
            Path(vocab_file).name,
            pat_str=pattern,
            mergeable_ranks=ranks,
            special_tokens={token.content: token_id for token_id, token in added.items()},
        )
        super().__init__(added_tokens_decoder=added, **kwargs)

    @property
    def vocab_size(self) -> int:
        return len(self._id_to_token)

    def get_vocab(self) -> dict[str, int]:
        return {**self._token_to_id, **self.added_tokens_encoder}

    def _tokenize(self, text, **kwargs):
        # Added tokens are split out before this is called: `text` is ordinary text.
        return [self._id_to_token[i] for i in self._model.encode_ordinary(text)]

    def _convert_token_to_id(self, token):
        return self._token_to_id[token]

    def _convert_id_to_token(self, index):
        return self._id_to_token[index]

    def convert_tokens_to_string(self, tokens):
        added = self.added_tokens_encoder
        data = b"".join(t.encode("utf-8") if t in added else t.encode("latin-1") for t in tokens)
        return data.decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory, filename_prefix=None):
        target = Path(save_directory) / ((filename_prefix + "-" if filename_prefix else "") + "tiktoken.model")
        if Path(self.vocab_file).resolve() != target.resolve():
            shutil.copyfile(self.vocab_file, target)
        return (str(target),)


REMOTE_CODE_NAME = "tokenization_tiktoken"


def write_remote_code_dir(files_dir: str | Path, out_dir: str | Path) -> Path:
    """A model directory's tokenizer files from `files_dir` (tiktoken.model, tokenizer_config.json,
    chat_template.jinja), loading this tokenizer as its remote code."""
    files_dir, out_dir = Path(files_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("tiktoken.model", "chat_template.jinja"):
        shutil.copy2(files_dir / name, out_dir / name)
    shutil.copy2(__file__, out_dir / f"{REMOTE_CODE_NAME}.py")
    config = json.loads((files_dir / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": [f"{REMOTE_CODE_NAME}.{TiktokenTokenizer.__name__}", None]}
    config["tokenizer_class"] = TiktokenTokenizer.__name__
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out_dir
