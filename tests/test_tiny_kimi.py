"""The tiny Kimi target (config/tiny-kimi.yaml): DeepSeek-V3 with Kimi-K2.5's real tokenizer, end to end."""

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from eagle3_datagen.formats.files import read_jsonl
from eagle3_datagen.formats.hidden_shard import HiddenShard
from eagle3_datagen.stages.tokens import loss_spans

from .conftest import KIMI_FILES, REPO, copy_workflow, leave_out_baseline, snakemake

pytestmark = pytest.mark.e2e

CONFIG = ["--profile", "profiles/local", "--configfile", "config/tiny-kimi.yaml"]
PARTITIONS = {"tiny_chat": 2, "tiny_glaive": 1}
REASONING = "I will answer briefly."


@pytest.fixture(scope="module")
def tiny_kimi_responses(tmp_path_factory):
    """The workflow copied and run with config/tiny-kimi.yaml up to the responses (model built and fitted),
    without the baseline it ships on (evaluate.baseline: its twins would double the evaluate jobs;
    tests/test_baseline_workflow.py measures a draft against its twin's on the demo)."""
    work = copy_workflow(tmp_path_factory.mktemp("tiny-kimi") / "wf")
    leave_out_baseline(work / "config/tiny-kimi.yaml")
    responses = [f"results/{p}/responses/{s:05d}.jsonl.zst" for p, n in PARTITIONS.items() for s in range(n)]
    snakemake([*responses, *CONFIG], work)  # targets first: --configfile takes every word after it
    return work


@pytest.fixture(scope="module")
def tiny_kimi_dir(tiny_kimi_responses):
    """The rest of the workflow: tokens, hidden states, probe, vocabulary, exports, report."""
    snakemake(CONFIG, tiny_kimi_responses)
    return tiny_kimi_responses


def test_model_directory_is_a_kimi_one(tiny_kimi_responses):
    model = tiny_kimi_responses / "results/tiny-kimi/model"
    config = json.loads((model / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["vocab_size"] == 163840 and config["num_hidden_layers"] == 8
    assert config["rope_scaling"]["type"] == "yarn" and config["num_nextn_predict_layers"] == 0
    assert (config["n_group"], config["topk_group"], config["topk_method"], config["scoring_func"]) == (
        1,
        1,
        "noaux_tc",
        "sigmoid",
    )
    for name in ("tiktoken.model", "chat_template.jinja"):
        assert (model / name).read_bytes() == (KIMI_FILES / name).read_bytes()
    with safe_open(model / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
        assert weights.get_slice("lm_head.weight").get_shape() == [163840, 64]
    # Checkpoint names as DeepSeek-V3 and Kimi ship them: one tensor per expert, MLA projections.
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in names
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in names
    assert {"model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"} <= names
    from transformers import AutoConfig, AutoTokenizer

    loaded = AutoConfig.from_pretrained(model)
    assert loaded.rope_parameters["rope_type"] == "yarn" and loaded.rope_parameters["factor"] == 64.0
    assert AutoTokenizer.from_pretrained(model).convert_tokens_to_ids("<|im_end|>") == 163586


def assistant_turns(work, partition):
    return [
        m
        for s in range(PARTITIONS[partition])
        for r in read_jsonl(work / f"results/{partition}/responses/{s:05d}.jsonl.zst")
        for m in r["messages"]
        if m["role"] == "assistant"
    ]


def test_greedy_generation_reasons_then_answers_as_fitted(tiny_kimi_responses):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_kimi_responses / "results/tiny-kimi/model")
    chat = assistant_turns(tiny_kimi_responses, "tiny_chat")
    assert len(chat) == 14  # 12 conversations, two of them with a second user turn
    expected = {
        json.loads(line)["messages"][-1]["content"] for line in (REPO / "resources/tiny-kimi/data/chat.jsonl").open()
    }
    for turn in chat:
        assert turn["finish_reason"] == "stop" and turn["reasoning"] == REASONING and not turn.get("malformed")
        assert tokenizer.decode(turn["output_ids"]) == f"{REASONING}</think>{turn['content']}<|im_end|>"
    assert expected <= {t["content"] for t in chat}
    glaive = assistant_turns(tiny_kimi_responses, "tiny_glaive")
    assert all(t["reasoning"] == REASONING and not t.get("malformed") for t in glaive)
    assert [t["finish_reason"] for t in glaive if not t.get("tool_calls")] == ["stop"] * 6


def test_tool_prompts_get_kimi_tool_calls(tiny_kimi_responses):
    turns = assistant_turns(tiny_kimi_responses, "tiny_glaive")
    calls = [t for t in turns if t.get("tool_calls")]
    names = sorted(c["tool_calls"][0]["function"]["name"] for c in calls)
    assert names == ["calculate_square_root", "get_exchange_rate", "get_weather", "get_weather"]
    assert all(c["finish_reason"] == "tool_calls" and c["tool_calls"][0]["id"].startswith("functions.") for c in calls)
    # each matched call is followed by the recorded result and the fitted answer after it
    assert sum("degrees" in t["content"] for t in turns) == 2


def test_tokens_train_each_turn_as_the_model_emitted_it(tiny_kimi_dir):
    for partition, shards in PARTITIONS.items():
        for s in range(shards):
            responses = {
                r["id"]: r for r in read_jsonl(tiny_kimi_dir / f"results/{partition}/responses/{s:05d}.jsonl.zst")
            }
            samples = read_jsonl(tiny_kimi_dir / f"results/{partition}/tokens/{s:05d}.jsonl.zst")
            assert len(samples) >= len(responses) > 0
            for sample in samples:
                turns = [m for m in responses[sample["id"].split("#")[0]]["messages"] if m["role"] == "assistant"]
                assert loss_spans(sample["input_ids"], sample["loss_mask"])[-1] in [t["output_ids"] for t in turns]
            audit = json.loads((tiny_kimi_dir / f"results/{partition}/tokens/{s:05d}.audit.json").read_text())
            assert audit["special_tokens"]["end_of_turn_id"] == 163586


def test_hidden_states_probe_and_exports_on_the_kimi_architecture(tiny_kimi_dir):
    for partition, shards in PARTITIONS.items():
        tokens = read_jsonl(tiny_kimi_dir / f"results/{partition}/tokens/00000.jsonl.zst")
        shard_dir = tiny_kimi_dir / f"results/{partition}/hidden/00000"
        index = json.loads((shard_dir / "index.json").read_text())
        assert index["aux_layers"] == [2, 4, 5] and HiddenShard(shard_dir).ids == [t["id"] for t in tokens]
        first = next(iter(HiddenShard(shard_dir)))
        assert first["aux_hidden_states"].shape == (len(tokens[0]["input_ids"]), 3 * 64)
        probe = json.loads((tiny_kimi_dir / f"results/report/{partition}.json").read_text())["probe"]
        assert probe["verdicts"] == {"ok": shards} and probe["greedy_exact"] is True
        assert probe["last_turn"]["top1_agreement"] >= 0.98
        shard = json.loads((tiny_kimi_dir / f"results/{partition}/probe/00000.json").read_text())
        assert shard["tensors_loaded"] == ["lm_head.weight", "model.norm.weight"]  # Kimi's head is untied
        hidden = sum(len(HiddenShard(tiny_kimi_dir / f"results/{partition}/hidden/{s:05d}")) for s in range(shards))
        for fmt in ("specforge", "speculators"):
            summary = json.loads((tiny_kimi_dir / f"results/{partition}/export/{fmt}/export.json").read_text())
            assert summary["samples"] + summary["held_out"] == hidden and summary["held_out"] > 0
        # the evaluate stage on the Kimi architecture: a draft measured on the held-out samples
        figures = json.loads((tiny_kimi_dir / f"results/{partition}/evaluate/acceptance.json").read_text())
        assert figures["prompts"] == summary["held_out"] and 1.0 <= figures["acceptance_length"] <= 4.0
    together = json.loads((tiny_kimi_dir / "results/evaluate/acceptance.json").read_text())
    assert together["prompts"] == sum(
        json.loads((tiny_kimi_dir / f"results/{p}/evaluate/acceptance.json").read_text())["prompts"] for p in PARTITIONS
    )
    assert 1.0 <= together["acceptance_length"] <= 4.0
    d2t, t2d = np.load(tiny_kimi_dir / "results/vocab/d2t.npy"), np.load(tiny_kimi_dir / "results/vocab/t2d.npy")
    assert d2t.shape == (256,) and t2d.shape == (163840,) and t2d.sum() == 256
    assert (np.arange(256) + d2t).tolist() == np.flatnonzero(t2d).tolist()
    assert t2d[163586] and t2d[163607]  # <|im_end|> and </think> are drafted


def test_hidden_states_equal_a_direct_transformers_forward(tiny_kimi_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_kimi_dir / "results/tiny-kimi/model").eval()
    stored = next(iter(HiddenShard(tiny_kimi_dir / "results/tiny_glaive/hidden/00000")))
    with torch.no_grad():
        out = model(stored["input_ids"][None].long(), output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i][0] for i in (2, 4, 5)], dim=-1)
    torch.testing.assert_close(stored["aux_hidden_states"].float(), aux, atol=2e-2, rtol=1e-2)
