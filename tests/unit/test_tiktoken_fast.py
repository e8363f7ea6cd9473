"""The fast tokenizer built from Kimi-K2.5's real `tiktoken.model` against `tiktoken` itself."""

import tiktoken
from tiktoken.load import load_tiktoken_bpe

from eagle3_datagen.chat.tiktoken_fast import KIMI_PATTERN, read_added_tokens
from tests.helpers import KIMI_FILES

TEXTS = [
    "Hello world 1234567 89",
    "  def f(x):\n\treturn x**2\n\n\n",
    "I'm HAPPY they'll go; DON'T. Émile naïve café",
    "中文English混合123４５６，你好世界！",
    "emoji 🎉🎉 and\u00a0nbsp\r\nwindows\rline",
    "<|im_end|> <think>reason</think>tail <|tool_call_begin|>",
    "Ωμέγα ΑΒΓ русский ТЕКСТ 日本語のテキスト 한국어",
]


def test_ids_equal_tiktoken_on_kimi_ranks_and_pattern(kimi_fast):
    specials = {f"<|reserved_token_{i}|>": i for i in range(163584, 163840)}
    specials |= {token["content"]: i for i, token in read_added_tokens(KIMI_FILES).items()}
    reference = tiktoken.Encoding(
        "kimi",
        pat_str=KIMI_PATTERN,
        mergeable_ranks=load_tiktoken_bpe(str(KIMI_FILES / "tiktoken.model")),
        special_tokens=specials,
    )
    for text in TEXTS:
        assert kimi_fast.encode(text, add_special_tokens=False) == reference.encode(text, allowed_special="all"), text


def test_vocabulary_special_ids_and_flags(kimi_fast):
    assert len(kimi_fast) == 163840
    ids = {t: kimi_fast.convert_tokens_to_ids(t) for t in ["[BOS]", "[EOS]", "<|im_end|>", "<|im_middle|>", "<think>"]}
    assert ids == {"[BOS]": 163584, "[EOS]": 163585, "<|im_end|>": 163586, "<|im_middle|>": 163601, "<think>": 163606}
    assert kimi_fast.convert_ids_to_tokens(163700) == "<|reserved_token_163700|>"
    # <think>, </think> and the tool-call tokens are not special: skip_special_tokens keeps them.
    ids = kimi_fast.encode("<|im_end|><think>a</think><|tool_call_begin|>", add_special_tokens=False)
    assert kimi_fast.decode(ids, skip_special_tokens=True) == "<think>a</think><|tool_call_begin|>"
    # Digits group by three; a Han run is its own pre-token.
    assert [kimi_fast.decode([i]) for i in kimi_fast.encode("1234567", add_special_tokens=False)] == ["123", "456", "7"]
