"""Tiny targets of the other families' architectures, with their real tokenizers and chat templates.

The model is built from the real `config.json` that sits beside the tokenizer files (Qwen3-8B's,
Qwen3-4B-2507's, gpt-oss-20b's, Llama-3.1-8B-Instruct's: tests/fixtures/targets), shrunk to the
`demo` section's widths and depth, so every stage meets the architecture's real keys and vocabulary:
Qwen3 dense, Qwen3-MoE (Qwen3's config with the MoE keys of Qwen3-30B-A3B's layout, no real MoE config
being at hand), gpt-oss (MoE, attention sinks, alternating sliding-window layers, YaRN), Llama 3.1
(llama3 rope scaling), and DeepSeek-V3 in the tiny Kimi's config layout (DeepSeek-V3.1 ships no
config.json here). Like the tiny Kimi it is fitted to what the model emits after each generation prompt
of its partitions, in the format the template implies (`chat.turns.TemplateTurns`): the answers and
calls are the conversations' own, the reasoning one canned sentence.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from eagle3_datagen.chat.families.target_chat import TargetChat, load_chat
from eagle3_datagen.chat.template import encode, render_generation_prompt
from eagle3_datagen.chat.turns import ReasoningDroppedError, TemplateTurns
from eagle3_datagen.formats.checkpoint import write_safetensors_index
from eagle3_datagen.formats.files import atomic_dir
from eagle3_datagen.targets.demo import fit_to_conversations
from eagle3_datagen.targets.tiny_kimi import FIT_BATCH_TOKENS, fitting_turns, tiny_kimi_config

# The real config's model_type each architecture shrinks (Qwen3-MoE is built from a dense Qwen3's).
REAL_MODEL_TYPE = {"qwen3": "qwen3", "qwen3_moe": "qwen3", "gpt_oss": "gpt_oss", "llama": "llama"}
# gpt-oss's sliding window (128), shrunk like its widths so that the tiny runs' samples cross it.
TINY_SLIDING_WINDOW = 32
# Written here from the model rather than copied from the tokenizer's folder.
NOT_COPIED = {"config.json", "generation_config.json", "SHA256SUMS"}


def tiny_config(settings: dict, tokenizer: PreTrainedTokenizerBase) -> dict:
    """config.json of the tiny target: the real one beside the tokenizer (`settings["tokenizer"]`), shrunk to
    the `demo` section's sizes; DeepSeek-V3 in the tiny Kimi's layout with this tokenizer's special tokens."""
    architecture, moe = settings["architecture"], settings.get("moe")
    if architecture == "deepseek_v3":
        config = tiny_kimi_config(settings, tokenizer)
        config.update(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        return config
    path = Path(settings["tokenizer"]) / "config.json"
    real = json.loads(path.read_text())
    if real.get("model_type") != REAL_MODEL_TYPE[architecture]:
        raise ValueError(
            f"{path}: model_type {real.get('model_type')!r}, but demo.architecture {architecture} shrinks a "
            f"{REAL_MODEL_TYPE[architecture]} config; point demo.tokenizer at that family's folder"
        )
    layers = settings["num_layers"]
    config = {key: value for key, value in real.items() if key not in ("quantization_config", "transformers_version")}
    config.update(
        hidden_size=settings["hidden_size"],
        intermediate_size=settings["intermediate_size"],
        num_hidden_layers=layers,
        num_attention_heads=settings["num_heads"],
        num_key_value_heads=settings["num_kv_heads"],
        head_dim=settings["hidden_size"] // settings["num_heads"],
        torch_dtype="float32",
    )
    if "layer_types" in real:  # the real model's layer pattern, repeated over the tiny depth
        config["layer_types"] = [real["layer_types"][i % len(real["layer_types"])] for i in range(layers)]
    if "max_window_layers" in real:
        config["max_window_layers"] = layers
    if architecture in ("qwen3_moe", "gpt_oss") and moe["shared_experts"]:
        raise ValueError(f"demo.moe.shared_experts: {architecture} has no shared experts; set it to 0")
    if architecture == "qwen3_moe":
        config.update(
            architectures=["Qwen3MoeForCausalLM"],
            model_type="qwen3_moe",
            num_experts=moe["routed_experts"],
            num_experts_per_tok=moe["experts_per_token"],
            moe_intermediate_size=moe["intermediate_size"],
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            output_router_logits=False,
            router_aux_loss_coef=0.001,
        )
    elif architecture == "gpt_oss":
        config.update(
            num_local_experts=moe["routed_experts"],
            num_experts_per_tok=moe["experts_per_token"],
            experts_per_token=moe["experts_per_token"],
            intermediate_size=moe["intermediate_size"],
            sliding_window=TINY_SLIDING_WINDOW,
        )
    return config


def tiny_model(config: dict, seed: int) -> PreTrainedModel:
    """A randomly initialised model of `config` (seeded), built by transformers' own class for it."""
    torch.manual_seed(seed)
    settings = {key: value for key, value in config.items() if key not in ("model_type", "architectures")}
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **settings))


def target_chat(settings: dict) -> TargetChat:
    """The chat of the tokenizer folder, with the run's template switches, date and family (`settings["chat"]`)."""
    model = {"trust_remote_code": False, "special_tokens": {}, **settings["chat"]}
    return load_chat(settings["tokenizer"], model)


def fitting_samples(
    partitions: list[dict], chat: TargetChat, reasoning: str
) -> tuple[list[list[int]], list[list[int]]]:
    """`fitting_turns` with each turn as the template implies the model emits it (`TemplateTurns.emitted`)."""
    turns = TemplateTurns(chat.tokenizer, chat.specials, chat.template_kwargs, chat.family)

    def emitted_turn(prompt: dict, history: list[dict], turn: dict) -> tuple[list[int], list[int]]:
        tools = prompt.get("tools")
        prompt_ids = render_generation_prompt(chat.tokenizer, history, tools, chat.template_kwargs, chat.family)
        rendered = turns.render(history, False, tools), turns.render(history, True, tools)
        try:
            emitted = turns.emitted(prompt["id"], [*history, turn], tools, *rendered)
        except ReasoningDroppedError:  # no place for reasoning here (DeepSeek-V3.1 after tool output)
            emitted = turns.emitted(prompt["id"], [*history, {**turn, "reasoning": ""}], tools, *rendered)
        return prompt_ids, encode(chat.tokenizer, emitted)

    return fitting_turns(partitions, reasoning, emitted_turn)


def write_model_dir(
    out_dir: str | Path, model: PreTrainedModel, config: dict, tokenizer_dir: Path, build: dict
) -> None:
    """The model directory (atomically): the tokenizer folder's files as they are (licences included),
    weights with their safetensors index, the shrunk config.json in the real one's layout."""
    with atomic_dir(out_dir) as tmp:
        for source in sorted(tokenizer_dir.iterdir()):
            if source.is_file() and source.name not in NOT_COPIED:
                shutil.copyfile(source, tmp / source.name)
        model.save_pretrained(tmp, safe_serialization=True)
        write_safetensors_index(tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "demo_build.json").write_text(json.dumps(build, indent=2) + "\n")


def build_tiny_family(partitions: list[dict], out_dir: str | Path, settings: dict) -> dict:
    """Build, fit and write a tiny target of `settings["architecture"]`. Returns build facts for the log."""
    tokenizer_dir = Path(settings["tokenizer"])
    chat = target_chat(settings)
    tokenizer = chat.tokenizer
    config = tiny_config(settings, tokenizer)
    model = tiny_model(config, settings["seed"])
    sequences, masks = fitting_samples(partitions, chat, settings["reasoning"])
    losses = fit_to_conversations(
        model,
        sequences,
        settings["train_steps"],
        settings["learning_rate"],
        settings["seed"],
        loss_masks=masks,
        max_batch_tokens=FIT_BATCH_TOKENS,
    )
    model.generation_config.eos_token_id = chat.specials.stop_ids
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    build = {"settings": settings, "samples": len(sequences), "losses": losses}
    write_model_dir(out_dir, model, config, tokenizer_dir, build)
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "samples": len(sequences),
        "trained_tokens": sum(sum(m) for m in masks),
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
    }
