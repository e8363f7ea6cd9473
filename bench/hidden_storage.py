#!/usr/bin/env python
"""Hidden-state storage settings compared on the same states: bytes, speed and what they cost.

States come from greedy continuations (so the probe's agreement is meaningful) of four sources:
(a) the demo model (`results/demo/model`, build it with `make demo` or its build_demo_model rule),
(b) a tiny random DeepseekV3 (Kimi-K2.5's architecture: MLA attention, MoE; built from a config
here), (c) the demo model's states with massive-activation outliers injected (a few channels of
every auxiliary layer scaled 100-1000x), and (d) the tiny Kimi model (`results/tiny-kimi/model`:
DeepseekV3 with Kimi-K2.5's real tokenizer, fitted like the demo model; build it with
`snakemake results/tiny-kimi/model --profile local --configfile config/tiny-kimi.yaml`) on its own
prompts. Each is captured once in float32; every setting then
writes the same states with `capture_shard` and reads them back with `HiddenShard`, on one
thread, timed in CPU time (process_time: other jobs on a shared machine do not count). Per
setting: bytes per token and ratio to bf16 (on disk), write and read MB/s (of bf16 bytes), the
probe's top-1 agreement and mean log-prob on all probed positions, the agreement lost against
the bf16 reference rows (fp8), and the worst auxiliary layer's relative error and cosine against
the bf16 states (all tokens). Then byte-plane layouts of the bf16 auxiliary states, measured
directly with zstd.

Usage: python bench/hidden_storage.py [--samples 64] [--new-tokens 128] (after building both models)
"""

import argparse
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import zstandard
from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

from eagle3_datagen.backends.hf.capture import HFCapture
from eagle3_datagen.chat.template import render_generation_prompt, render_ids
from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.formats.datasets import normalize, recorded_conversations
from eagle3_datagen.formats.hidden_shard import HiddenShard
from eagle3_datagen.stages.hidden.shard import capture_shard
from eagle3_datagen.stages.probe import LMHead, ProbeSettings, probe_shard

DEMO_SOURCES = (("alpaca.json", "alpaca"), ("openai.jsonl", "auto"), ("sharegpt.jsonl", "sharegpt"))
SETTINGS = [
    {"dtype": "bfloat16", "compress": "none"},
    {"dtype": "bfloat16", "compress": "zstd"},
    {"dtype": "bfloat16", "compress": "zstd_planes"},
    *(
        {"dtype": dtype, "scales": scales, "compress": compress}
        for dtype in ("float8_e4m3", "float8_e5m2")
        for scales in ("token", "channel", "block")
        for compress in ("none", "zstd")
    ),
]
DEMO_DATA = {f"resources/demo/data/{name}": fmt for name, fmt in DEMO_SOURCES}
KIMI_DATA = {"resources/tiny-kimi/data/chat.jsonl": "auto", "resources/tiny-kimi/data/glaive.json": "glaive"}
PROBED = 2048  # positions the probe reads, and bf16 reference rows kept for it
OUTLIERS = {3: 100.0, 17: 300.0, 40: 1000.0}  # channel of each auxiliary layer -> factor


class Replay:
    """A capture that returns states captured earlier (the same states for every setting)."""

    def __init__(self, capture: HFCapture, states: dict[tuple, tuple]):
        self.states = states
        self.packed, self.ranks = capture.packed, capture.ranks
        self.model_name, self.num_layers, self.hidden_size = capture.model_name, capture.num_layers, capture.hidden_size
        self.aux_layers, self.final = capture.aux_layers, capture.final

    def __call__(self, batch):
        return [self.states[tuple(ids)] for ids in batch]


def tiny_deepseek_v3(path: Path, vocab_size: int) -> Path:
    """Kimi-K2.5's text architecture (DeepseekV3) at toy size, random weights."""
    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    DeepseekV3ForCausalLM(config).save_pretrained(path)
    return path


def greedy_samples(model_dir: Path, prompts: list[list[int]], new_tokens: int, batch: int = 16) -> list[dict]:
    """Each prompt with the model's greedy continuation up to its end-of-turn token or `new_tokens`
    (left-padded batches), loss-masked on the continuation."""
    lm = HFCapture(model_dir, "auto", "normed", {"dtype": "float32", "device": "cpu"}).lm
    eos = lm.generation_config.eos_token_id
    samples = []
    for start in range(0, len(prompts), batch):
        rows = prompts[start : start + batch]
        longest = max(len(r) for r in rows)
        ids = torch.tensor([[0] * (longest - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (longest - len(r)) + [1] * len(r) for r in rows])
        with torch.inference_mode():
            out = lm.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        for k, prompt in enumerate(rows):
            continuation = out[k, longest:].tolist()
            if eos in continuation:
                continuation = continuation[: continuation.index(eos) + 1]
            mask = [0] * len(prompt) + [1] * len(continuation)
            samples.append({"id": f"g{start + k}", "input_ids": prompt + continuation, "loss_mask": mask})
    return samples


def captured(model_dir: Path, samples: list[dict], outliers: bool = False) -> Replay:
    capture = HFCapture(model_dir, "auto", "normed", {"dtype": "float32", "device": "cpu"})
    states = {}
    for sample in samples:
        aux, final = capture([sample["input_ids"]])[0]
        if outliers:
            aux = aux.clone()
            for layer in range(len(capture.aux_layers)):
                for channel, factor in OUTLIERS.items():
                    aux[:, layer * capture.hidden_size + channel] *= factor
        states[tuple(sample["input_ids"])] = (aux, final)
    return Replay(capture, states)


def worst_layer_error(shard: HiddenShard, replay: Replay, samples: list[dict]) -> tuple[float, float]:
    """Largest relative error and smallest mean cosine over the auxiliary layers, all tokens."""
    hidden, errors, cosines = replay.hidden_size, [], []
    stored = {s["id"]: s["aux_hidden_states"] for s in shard.iter_samples(("aux_hidden_states",))}
    for layer in range(len(replay.aux_layers)):
        columns = slice(layer * hidden, (layer + 1) * hidden)
        ref = torch.cat([replay.states[tuple(s["input_ids"])][0][:, columns].bfloat16().float() for s in samples])
        got = torch.cat([stored[s["id"]][:, columns].float() for s in samples])
        errors.append(float((got - ref).norm() / ref.norm()))
        cosines.append(float(torch.nn.functional.cosine_similarity(got, ref, dim=-1).mean()))
    return max(errors), min(cosines)


def run_setting(setting: dict, replay: Replay, samples: list[dict], head: LMHead, work: Path) -> dict:
    """Bytes and speed of a shard without reference rows; the probe on a second copy that keeps
    `PROBED` bf16 reference rows (fp8 only)."""
    sweep = {"shard_bytes": 64 << 20, "max_batch_tokens": 1 << 20, "reference_positions": 0, **setting}
    settings = fill_defaults(sweep, "hidden_states")
    out = work / "_".join(setting.values())
    tokens = sum(len(s["input_ids"]) for s in samples)
    bf16_bytes = tokens * ((len(replay.aux_layers) + 1) * replay.hidden_size * 2 + 5)
    start = time.process_time()  # CPU time of this one thread: other jobs on the machine do not count
    index = capture_shard(samples, out, replay, settings)
    write_s = time.process_time() - start
    shard = HiddenShard(out)
    start = time.process_time()
    for _ in shard:
        pass
    read_s = time.process_time() - start
    probed = out
    if shard.codec.fp8:
        probed = work / f"{out.name}_reference"
        capture_shard(samples, probed, replay, {**settings, "reference_positions": PROBED})
    probe = probe_shard(probed, head, ProbeSettings.from_config(fill_defaults({"max_positions": PROBED}, "probe")))
    cost = probe["storage_cost"]
    error, cosine = worst_layer_error(shard, replay, samples)
    return {
        "setting": " ".join(v for k, v in setting.items() if v != "none"),
        "bytes_per_token": index["bytes"] / tokens,
        "ratio": index["bytes"] / bf16_bytes,
        "write": bf16_bytes / 1e6 / write_s,
        "read": bf16_bytes / 1e6 / read_s,
        "agreement": probe["all"]["top1_agreement"],
        "logprob": probe["all"]["mean_logprob"],
        "drop": cost["agreement_drop"] if cost else 0.0,
        "error": error,
        "cosine": cosine,
    }


def plane_layouts(replay: Replay, level: int = 3) -> list[tuple[str, float, float, float]]:
    """zstd ratio, compress and decompress MB/s of bf16 aux states under byte-plane layouts."""
    aux = torch.cat([a for a, _ in replay.states.values()]).bfloat16()
    tokens, columns = aux.shape
    layers = columns // replay.hidden_size
    u8 = aux.view(torch.uint8).reshape(tokens, columns, 2).numpy()
    layouts = {
        "none (bf16 as stored)": u8,
        "planes [2, T, C]": u8.transpose(2, 0, 1),
        "planes by layer [L, 2, T, H]": u8.reshape(tokens, layers, -1, 2).transpose(1, 3, 0, 2),
        "planes channel-major [2, C, T]": u8.transpose(2, 1, 0),
    }
    rows = []
    for name, view in layouts.items():
        start = time.process_time()
        data = np.ascontiguousarray(view).tobytes()
        packed = zstandard.ZstdCompressor(level=level).compress(data)
        write_s = time.process_time() - start
        start = time.process_time()
        zstandard.ZstdDecompressor().decompress(packed)
        read_s = time.process_time() - start
        rows.append((name, len(packed) / len(data), len(data) / 1e6 / write_s, len(data) / 1e6 / read_s))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--demo-model", default="results/demo/model")
    p.add_argument("--kimi-model", default="results/tiny-kimi/model")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    args = p.parse_args()
    torch.set_num_threads(1)
    demo, kimi = Path(args.demo_model), Path(args.kimi_model)
    rng = np.random.default_rng(0)
    tokenizer = AutoTokenizer.from_pretrained(demo)
    conversations = [messages for path, fmt in DEMO_DATA.items() for _, messages in recorded_conversations(path, fmt)]
    # The demo's sources hold the same conversations in several formats: each prompt once, then
    # random token IDs (so that no two samples share states, which zstd would find).
    unique = {tuple(render_ids(tokenizer, m[:2], True, {"enable_thinking": False})) for m in conversations}
    prompts = [list(p) for p in sorted(unique)][: args.samples]
    prompts += [rng.integers(0, len(tokenizer), 48).tolist() for _ in range(args.samples - len(prompts))]
    # The tiny Kimi model's own prompts (tools declared where the glaive records have them), then random IDs.
    kimi_tokenizer = AutoTokenizer.from_pretrained(kimi)
    kimi_prompts = [
        render_generation_prompt(kimi_tokenizer, prompt["messages"], prompt.get("tools"))
        for path, fmt in KIMI_DATA.items()
        for prompt in normalize(path, fmt, None, Counter())
    ][: args.samples]
    kimi_prompts += [rng.integers(0, 163584, 48).tolist() for _ in range(args.samples - len(kimi_prompts))]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        demo_samples = greedy_samples(demo, prompts, args.new_tokens)
        deepseek = tiny_deepseek_v3(work / "deepseek", len(tokenizer))
        random_prompts = [rng.integers(0, len(tokenizer), 48).tolist() for _ in range(args.samples)]
        sources = {
            "demo model (Qwen3 tiny, hidden 64)": (demo, demo_samples, False),
            "tiny DeepseekV3 (Kimi architecture, random, hidden 64)": (
                deepseek,
                greedy_samples(deepseek, random_prompts, args.new_tokens),
                False,
            ),
            f"demo model, outliers injected in aux states {OUTLIERS}": (demo, demo_samples, True),
            "tiny Kimi model (DeepseekV3: MLA, MoE; Kimi-K2.5's tokenizer; fitted; hidden 64)": (
                kimi,
                greedy_samples(kimi, kimi_prompts, args.new_tokens),
                False,
            ),
        }
        for n, (title, (model_dir, samples, outliers)) in enumerate(sources.items()):
            replay = captured(model_dir, samples, outliers)
            head = LMHead(model_dir)
            tokens = sum(len(s["input_ids"]) for s in samples)
            print(f"\n### {title}: {len(samples)} samples, {tokens} tokens\n")
            print(
                "| setting | bytes/token | ratio to bf16 | write MB/s | read MB/s | top-1 agreement | mean log-prob "
                "| agreement lost vs bf16 rows | worst aux rel. error | worst aux cosine |"
            )
            print("|---|---|---|---|---|---|---|---|---|---|")
            for setting in SETTINGS:
                r = run_setting(setting, replay, samples, head, work / f"source{n}")
                print(
                    f"| {r['setting']} | {r['bytes_per_token']:.1f} | {r['ratio']:.3f} | {r['write']:.0f} | "
                    f"{r['read']:.0f} | {r['agreement']:.4f} | {r['logprob']:.3f} | {r['drop']:+.4f} | "
                    f"{r['error']:.4f} | {r['cosine']:.5f} |"
                )
            print("\n| bf16 aux states, zstd level 3 | ratio | compress MB/s | decompress MB/s |\n|---|---|---|---|")
            for name, ratio, write, read in plane_layouts(replay):
                print(f"| {name} | {ratio:.3f} | {write:.0f} | {read:.0f} |")


if __name__ == "__main__":
    main()
