"""A tiny Kimi-K2.5-architecture target: DeepSeek-V3 (MLA attention, MoE) with Kimi's real tokenizer.

The model is built from a config in Kimi's own `config.json` layout, so the workflow's stages
meet the production architecture and vocabulary (163,840) on CPU. It is fitted, like the Qwen3
demo model, to what a Kimi model emits after K2.5's generation prompt (which ends in `<think>`):
`{reasoning}</think>{answer}<|im_end|>`, or for a recorded tool call
`{reasoning}</think><|tool_calls_section_begin|>...<|tool_calls_section_end|><|im_end|>`.
The answers and calls are the conversations' own; the reasoning is one canned sentence.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, PreTrainedTokenizerBase

from eagle3_datagen.chat.template import SpecialTokens, encode, render_generation_prompt, resolve_special_tokens
from eagle3_datagen.chat.tiktoken_fast import fast_tokenizer_from_tiktoken
from eagle3_datagen.chat.tool_calls import ToolCallMarkers, derive_markers
from eagle3_datagen.formats.checkpoint import write_safetensors_index
from eagle3_datagen.formats.datasets import normalize, recorded_conversations
from eagle3_datagen.formats.files import atomic_dir
from eagle3_datagen.targets.demo import fit_to_conversations

# The tokenizer files a Kimi model directory ships beside its weights.
KIMI_TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja")
# Tool prompts are several times longer than chat ones: fit in batches of similar length.
FIT_BATCH_TOKENS = 1024
# The untrained vocabulary rows (~160k of 163,840) in the fit's softmax, through a sample of this many:
# without them they keep most of the mass and the model samples noise at temperature 1.
FIT_UNTRAINED_SAMPLE = 2048


def tiny_kimi_config(settings: dict, tokenizer: PreTrainedTokenizerBase) -> dict:
    """config.json in Kimi-K2's layout (DeepSeek-V3 keys, YaRN rope, sigmoid top-k MoE), tiny sizes.

    `settings`: the config's `demo` section (`hidden_size`, `num_layers`, `num_heads`, `moe`, `mla`, ...).
    Every MoE layer routes over `moe.routed_experts` experts in one group (Kimi's `n_group: 1`).
    """
    moe, mla = settings["moe"], settings["mla"]
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": len(tokenizer),
        "hidden_size": settings["hidden_size"],
        "intermediate_size": settings["intermediate_size"],
        "moe_intermediate_size": moe["intermediate_size"],
        "num_hidden_layers": settings["num_layers"],
        "num_attention_heads": settings["num_heads"],
        "num_key_value_heads": settings["num_kv_heads"],
        "n_routed_experts": moe["routed_experts"],
        "num_experts_per_tok": moe["experts_per_token"],
        "n_shared_experts": moe["shared_experts"],
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.827,
        "seq_aux": True,
        "aux_loss_alpha": 0.001,
        "ep_size": 1,
        "q_lora_rank": mla["q_lora_rank"],
        "kv_lora_rank": mla["kv_lora_rank"],
        "qk_nope_head_dim": mla["qk_nope_head_dim"],
        "qk_rope_head_dim": mla["qk_rope_head_dim"],
        "v_head_dim": mla["v_head_dim"],
        "num_nextn_predict_layers": 0,
        "max_position_embeddings": 262144,
        "rope_theta": 50000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 64.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": tokenizer.convert_tokens_to_ids("[BOS]"),
        "eos_token_id": tokenizer.convert_tokens_to_ids("[EOS]"),
        "pad_token_id": tokenizer.pad_token_id,
        "torch_dtype": "float32",
    }


def tiny_kimi_model(config: dict, seed: int) -> DeepseekV3ForCausalLM:
    """A randomly initialised DeepseekV3ForCausalLM from `tiny_kimi_config`'s dict (seeded)."""
    torch.manual_seed(seed)
    return DeepseekV3ForCausalLM(DeepseekV3Config(**config))


def kimi_turn_text(turn: dict, specials: SpecialTokens, markers: ToolCallMarkers) -> str:
    """What a Kimi model emits after its generation prompt (which already opened the think block),
    in the markers the tokenizer and template give (`chat.template.resolve_special_tokens`,
    `chat.tool_calls.derive_markers`)."""
    calls = markers.render_calls(turn["tool_calls"]) if turn.get("tool_calls") else ""
    return f"{turn['reasoning']}{specials.think_end}{turn['content']}{calls}{specials.end_of_turn}"


def regeneration_turns(prompt: dict, original: list[dict], reasoning: str) -> list[tuple[list[dict], dict]]:
    """(history, turn) for each assistant turn the responses stage generates for `prompt`, when the model
    answers as the original conversation did (its answers and tool calls) after `reasoning`.

    `original`: the record's conversation as `formats.datasets.link_tool_calls` returns it (calls with Kimi's
    ids, results pointing at them). System and user turns are the prompt's own (as the prompts stage
    normalised them); recorded tool results follow a call only when the prompt keeps them, as it
    does when its tools are declared.
    """
    asked = iter(m for m in prompt["messages"] if m["role"] in ("system", "user"))
    keeps_results = any(m["role"] == "tool" for m in prompt["messages"])
    history: list[dict] = []
    if prompt["messages"][0]["role"] == "system" and original[0]["role"] != "system":
        history.append(next(asked))  # the partition's default system prompt
    turns = []
    for message in original:
        role = message["role"]
        if role in ("system", "user"):
            given = next(asked, None)
            if given is None:
                break
            history.append(given)
        elif role == "tool":
            if not keeps_results:
                break
            history.append(message)
        elif history and history[-1]["role"] != "assistant":
            turn = {"role": "assistant", "content": message.get("content") or "", "reasoning": reasoning}
            if message.get("tool_calls"):
                turn["tool_calls"] = message["tool_calls"]
            turns.append((list(history), turn))
            history.append(turn)
    return turns


def fitting_turns(
    partitions: list[dict], reasoning: str, encode_turn: Callable[[dict, list[dict], dict], tuple[list[int], list[int]]]
) -> tuple[list[list[int]], list[list[int]]]:
    """Token IDs and loss masks over each turn the responses stage generates for `partitions`' prompts
    (`regeneration_turns`): `encode_turn(prompt, history, turn)`'s generation prompt, then the turn as the
    model emits it (trained).

    `partitions`: `{"source", "format", "system_prompt"}` per partition, read as the prompts stage reads them.
    """
    sequences, masks = [], []
    for part in partitions:
        originals = dict(recorded_conversations(part["source"], part["format"]))
        for prompt in normalize(part["source"], part["format"], part.get("system_prompt"), Counter()):
            for history, turn in regeneration_turns(prompt, originals[prompt["source"]["line"]], reasoning):
                prompt_ids, turn_ids = encode_turn(prompt, history, turn)
                sequences.append(prompt_ids + turn_ids)
                masks.append([0] * len(prompt_ids) + [1] * len(turn_ids))
    return sequences, masks


def fitting_samples(
    partitions: list[dict], tokenizer: PreTrainedTokenizerBase, reasoning: str, template_kwargs: dict
) -> tuple[list[list[int]], list[list[int]]]:
    """`fitting_turns` with each turn in Kimi's markup (`kimi_turn_text`)."""
    specials = resolve_special_tokens(tokenizer, None, template_kwargs)
    markers = derive_markers(tokenizer, template_kwargs)

    def kimi_turn(prompt: dict, history: list[dict], turn: dict) -> tuple[list[int], list[int]]:
        prompt_ids = render_generation_prompt(tokenizer, history, prompt.get("tools"), template_kwargs)
        return prompt_ids, encode(tokenizer, kimi_turn_text(turn, specials, markers))

    return fitting_turns(partitions, reasoning, kimi_turn)


def write_kimi_model_dir(
    out_dir: str | Path, model: DeepseekV3ForCausalLM, config: dict, tokenizer_dir: Path, extra: dict
) -> None:
    """A Kimi-style model directory (atomically): weights, Kimi-layout config.json, Kimi's tokenizer files
    and a fast tokenizer (`tokenizer.json`) that loads without remote code."""
    tokenizer = fast_tokenizer_from_tiktoken(tokenizer_dir)
    with atomic_dir(out_dir) as tmp:
        tokenizer.save_pretrained(tmp)
        for name in KIMI_TOKENIZER_FILES:
            if name != "tokenizer_config.json":  # the saved one names the fast tokenizer, not Moonshot's code
                shutil.copyfile(tokenizer_dir / name, tmp / name)
        model.save_pretrained(tmp, safe_serialization=True)
        write_safetensors_index(tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name, content in extra.items():
            (tmp / name).write_text(json.dumps(content, indent=2) + "\n")


def build_tiny_kimi(partitions: list[dict], out_dir: str | Path, settings: dict) -> dict:
    """Build, fit and write the tiny Kimi target. Returns build facts for the log."""
    tokenizer_dir = Path(settings["tokenizer"])
    tokenizer = fast_tokenizer_from_tiktoken(tokenizer_dir)
    config = tiny_kimi_config(settings, tokenizer)
    model = tiny_kimi_model(config, settings["seed"])
    sequences, masks = fitting_samples(partitions, tokenizer, settings["reasoning"], settings["chat_template_kwargs"])
    losses = fit_to_conversations(
        model,
        sequences,
        settings["train_steps"],
        settings["learning_rate"],
        settings["seed"],
        loss_masks=masks,
        max_batch_tokens=FIT_BATCH_TOKENS,
        untrained_sample=FIT_UNTRAINED_SAMPLE,
    )
    model.generation_config.eos_token_id = resolve_special_tokens(tokenizer).end_of_turn_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = config["bos_token_id"]
    build = {"settings": settings, "samples": len(sequences), "losses": losses}
    write_kimi_model_dir(out_dir, model, config, tokenizer_dir, {"demo_build.json": build})
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "samples": len(sequences),
        "trained_tokens": sum(sum(m) for m in masks),
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
    }
