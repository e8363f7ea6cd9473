"""Build a SpecForge export as the workflow does, in the project's own venv (`.venv`, not the trainer's).

Run by tests/trainers/test_specforge.py: `.venv/bin/python tests/trainers/build_specforge_export.py
--arch demo|kimi --out DIR`. Writes `DIR/model` (the demo's tied-embedding Qwen3 with Qwen3's real
tokenizer, or the tiny Kimi's DeepseekV3 with Kimi's real tokenizer, at the sizes the workflow's configs
build, randomly initialised and written by the targets' own writers), `DIR/tokens.jsonl.zst` (greedy
continuations of random prompts, loss on the continuation), `DIR/vocab` (the vocabulary stage),
`DIR/hidden/raw` and `DIR/hidden/normed` (the hidden stage's shards of the same samples, `final: raw`
and `final: normed`), and the exports `DIR/export/{raw,normed}` (scripts/export.py, as the rule runs it), and
`DIR/export/raw-gzip` (the raw shard's rows gzipped, `export.specforge.compress: gzip`, on two threads).
"""

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

import torch

from eagle3_datagen.backends.hf.capture import HFCapture
from eagle3_datagen.chat.tiktoken_fast import fast_tokenizer_from_tiktoken
from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.formats.files import write_jsonl_zst
from eagle3_datagen.stages.hidden.shard import capture_shard
from eagle3_datagen.stages.vocab import run_vocab
from eagle3_datagen.targets.demo import qwen3_tokenizer, tiny_qwen3_config, write_demo_model_dir
from eagle3_datagen.targets.tiny_kimi import tiny_kimi_config, tiny_kimi_model, write_kimi_model_dir

REPO = Path(__file__).resolve().parents[2]
# The model sizes of config.yaml's and config/tiny-kimi.yaml's `demo` sections.
DEMO = {"hidden_size": 64, "intermediate_size": 192, "num_layers": 8, "num_heads": 4, "num_kv_heads": 2}
KIMI = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_layers": 8,
    "num_heads": 4,
    "num_kv_heads": 4,
    "moe": {"routed_experts": 4, "experts_per_token": 2, "shared_experts": 1, "intermediate_size": 32},
    "mla": {"q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16},
}
SAMPLES = 16
NORM_SCALE = 20.0
DRAFT_VOCAB = 256
HIDDEN_SETTINGS = fill_defaults({"dtype": "bfloat16", "shard_bytes": 64_000, "max_batch_tokens": 1024}, "hidden_states")


def build_model(arch: str, out: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch == "demo":
        tokenizer = qwen3_tokenizer()
        from transformers import Qwen3ForCausalLM

        model = Qwen3ForCausalLM(tiny_qwen3_config(len(tokenizer), DEMO))
    else:
        tokenizer_dir = REPO / "resources" / "kimi-k2.5"
        config = tiny_kimi_config(KIMI, fast_tokenizer_from_tiktoken(tokenizer_dir))
        model = tiny_kimi_model(config, 0)
    # A random model's next-token distributions are nearly flat (nothing for a draft to learn, and
    # top-1 ties): a larger final-norm weight makes them as peaked as a fitted model's.
    with torch.no_grad():
        model.model.norm.weight.fill_(NORM_SCALE)
    if arch == "demo":
        write_demo_model_dir(out, model, tokenizer, {"settings": DEMO, "losses": [], "norm_weight": NORM_SCALE})
    else:
        write_kimi_model_dir(out, model, config, tokenizer_dir, {})
    return model.eval()


def greedy_samples(model: torch.nn.Module, vocab: int) -> list[dict]:
    rng = random.Random(0)
    samples = []
    for i in range(SAMPLES):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(4, 16))]
        with torch.no_grad():
            ids = model.generate(
                torch.tensor([prompt]), max_new_tokens=rng.randint(8, 24), do_sample=False, pad_token_id=0
            )[0].tolist()
        samples.append(
            {"id": f"s{i:02d}", "input_ids": ids, "loss_mask": [0] * len(prompt) + [1] * (len(ids) - len(prompt))}
        )
    return samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--arch", choices=("demo", "kimi"), required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = Path(args.out)
    model = build_model(args.arch, out / "model")
    samples = greedy_samples(model, model.config.vocab_size)
    write_jsonl_zst(out / "tokens.jsonl.zst", samples)
    run_vocab([str(out / "tokens.jsonl.zst")], out / "model", DRAFT_VOCAB, out / "vocab")
    for final in ("raw", "normed"):
        capture = HFCapture(out / "model", "auto", final, {"dtype": "float32", "device": "cpu"})
        capture_shard(samples, out / "hidden" / final, capture, HIDDEN_SETTINGS)
        command = [sys.executable, str(REPO / "scripts" / "export.py"), "--format", "specforge"]
        command += ["--hidden", str(out / "hidden" / final), "--model", str(out / "model")]
        command += [
            "--vocab",
            str(out / "vocab"),
            "--draft-vocab-size",
            str(DRAFT_VOCAB),
            "--out",
            str(out / "export" / final),
        ]
        subprocess.run(command, check=True)
    # The raw shard's rows gzipped, on two threads, as the rule runs it with export.specforge.compress: gzip.
    gzipped = json.dumps({"formats": ["specforge"], "specforge": {"compress": "gzip", "compress_level": 1}})
    command = [sys.executable, str(REPO / "scripts" / "export.py"), "--format", "specforge"]
    command += ["--hidden", str(out / "hidden" / "raw"), "--model", str(out / "model"), "--vocab", str(out / "vocab")]
    command += ["--draft-vocab-size", str(DRAFT_VOCAB), "--settings", gzipped, "--threads", "2"]
    subprocess.run([*command, "--out", str(out / "export" / "raw-gzip")], check=True)


if __name__ == "__main__":
    main()
