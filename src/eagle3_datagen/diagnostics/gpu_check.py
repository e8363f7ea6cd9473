"""Compare SGLang with `hf` on one model: hidden states layer by layer, and generated IDs.

`scripts/gpu_check.py` runs this on a GPU node under torchrun (and, in the tests, on a CPU). The
two backends share nothing but the model's weights: transformers' hooks on one side, SGLang's
EAGLE-3 capture on the other, so agreement means the sglang backend stores the layers the
configuration names; a server's greedy `/generate` IDs are compared with transformers' greedy
generation of the same prompts. Both engines hold the model at once: a model two copies of which
do not fit the GPUs is compared on its first layers (`model_slice.py`).
"""

from __future__ import annotations

import json
import random
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from eagle3_datagen.backends.batching import capture_in_batches
from eagle3_datagen.diagnostics.model_slice import check_size, write_slice

# bf16 kernels differ between libraries; a wrong layer or a shifted token has cosine far below.
MIN_TOKEN_COSINE = 0.99
MIN_MEAN_COSINE = 0.999


@dataclass
class LayerAgreement:
    layer: str
    tokens: int
    max_abs: float
    rel_err: float
    mean_cosine: float
    min_cosine: float

    @property
    def ok(self) -> bool:
        return self.min_cosine >= MIN_TOKEN_COSINE and self.mean_cosine >= MIN_MEAN_COSINE


def compare(layer: str, ours: torch.Tensor, reference: torch.Tensor) -> LayerAgreement:
    """Agreement of two [tokens, hidden] tensors, in float32."""
    a, b = ours.float(), reference.float()
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    return LayerAgreement(
        layer=layer,
        tokens=a.shape[0],
        max_abs=(a - b).abs().max().item(),
        rel_err=((a - b).norm() / b.norm().clamp_min(1e-12)).item(),
        mean_cosine=cosine.mean().item(),
        min_cosine=cosine.min().item(),
    )


def random_batch(vocab_size: int, samples: int, seed: int = 0, lo: int = 8, hi: int = 512) -> list[list[int]]:
    """Token ID lists of mixed lengths; the states of any IDs exercise the same layers."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(samples)]


def agreement_by_layer(ours: list, reference: list, aux_layers: Sequence[int], final: str) -> list[LayerAgreement]:
    """Per stored layer, over all tokens of all samples: `ours` and `reference` are capture outputs."""
    aux = torch.cat([a for a, _ in ours])
    ref_aux = torch.cat([a for a, _ in reference])
    width = aux.shape[1] // len(aux_layers)
    rows = []
    for k, index in enumerate(aux_layers):
        columns = slice(k * width, (k + 1) * width)
        rows.append(compare(f"aux hidden_states[{index}]", aux[:, columns], ref_aux[:, columns]))
    rows.append(compare(f"final ({final})", torch.cat([f for _, f in ours]), torch.cat([f for _, f in reference])))
    return rows


def format_table(rows: list[LayerAgreement]) -> str:
    lines = [f"{'layer':<26} {'tokens':>7} {'max_abs':>9} {'rel_err':>9} {'mean_cos':>9} {'min_cos':>9}  verdict"]
    for r in rows:
        lines.append(
            f"{r.layer:<26} {r.tokens:>7} {r.max_abs:>9.4f} {r.rel_err:>9.5f} {r.mean_cosine:>9.6f} "
            f"{r.min_cosine:>9.6f}  {'ok' if r.ok else 'MISMATCH'}"
        )
    return "\n".join(lines)


def as_records(rows: list[LayerAgreement]) -> list[dict]:
    return [{**asdict(r), "ok": r.ok} for r in rows]


def write_check_model(out_dir: str | Path, seed: int = 0) -> Path:
    """A random Qwen3 with Qwen's real tokenizer, shaped for GPU attention kernels (head_dim 64)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from eagle3_datagen.targets.demo import qwen3_tokenizer

    out_dir = Path(out_dir)
    tokenizer = qwen3_tokenizer()
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
        torch_dtype="bfloat16",
    )
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@dataclass
class GenerateAgreement:
    prompts: int
    new_tokens: int
    exact: int  # prompts whose generated IDs equal transformers' exactly
    first_token: int  # prompts whose first generated ID equals transformers'

    @property
    def ok(self) -> bool:
        # bf16 kernels may break a near-tie late in a sequence; a wrong model or template differs at once.
        return self.first_token == self.prompts and self.exact >= 0.9 * self.prompts

    def row(self) -> str:
        return (
            f"{'generate (greedy ids)':<26} {self.prompts:>7} exact {self.exact}/{self.prompts}, "
            f"first token {self.first_token}/{self.prompts}, {self.new_tokens} new tokens  "
            f"{'ok' if self.ok else 'MISMATCH'}"
        )


def generate_agreement(
    url: str, model_dir: str | Path, prompts: list[list[int]], new_tokens: int, settings: dict
) -> GenerateAgreement:
    """A server's greedy `/generate` (input_ids in, output_ids back) against transformers' greedy generation."""
    from eagle3_datagen.backends.hf.model import load_causal_lm

    lm = load_causal_lm(model_dir, settings)
    exact = first = 0
    for ids in prompts:
        payload = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True},
        }
        request = urllib.request.Request(
            url.rstrip("/") + "/generate", json.dumps(payload).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            served = json.loads(response.read())["output_ids"]
        with torch.inference_mode():
            out = lm.generate(
                torch.tensor([ids], device=lm.device),
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        expected = out[0, len(ids) :].tolist()
        exact += served == expected
        first += served[:1] == expected[:1]
    return GenerateAgreement(len(prompts), new_tokens, exact, first)


def run_gpu_check(
    model_dir: str | Path | None,
    work_dir: str | Path,
    samples: int,
    max_batch_tokens: int,
    dtype: str,
    device: str = "cuda",
    url: str | None = None,
    launch_args: Sequence[str] | None = None,
    new_tokens: int = 32,
    trust_remote_code: bool = False,
    layers: int | None = None,
) -> tuple[bool, dict]:
    """On every torchrun rank: capture with SGLang (both finals), then on rank 0 with `hf` and
    compare; then, with `url` (launching a server there when `launch_args` is given), compare the
    server's greedy IDs with `hf`'s. `model_dir`'s first `layers` layers (default: sized to the GPUs'
    memory, `model_slice.check_size`). Returns (everything agrees, {"checked": what was loaded,
    "layers": per-layer records}) on rank 0."""
    import torch.distributed as dist

    from eagle3_datagen.backends.hf.capture import HFCapture
    from eagle3_datagen.backends.sglang.capture import (
        CPU_SERVER_FLAGS,
        SGLangCapture,
        SGLangModelRunner,
        TensorParallelRanks,
        join_torchrun,
        server_flags,
    )
    from eagle3_datagen.backends.sglang.server import launched_server
    from eagle3_datagen.config_schema import fill_defaults

    rank, local_rank = join_torchrun(device)
    ranks = TensorParallelRanks()
    checked = None
    if ranks.writer:  # rank 0 builds the model or its slice; every rank loads it from rank 0's path
        if model_dir is None:
            model_dir = write_check_model(Path(work_dir) / "check-model")
        gpu_bytes = None if device == "cpu" else node_gpu_bytes()
        size = check_size(model_dir, gpu_bytes, layers)
        if not size.whole:
            model_dir = write_slice(model_dir, size.layers, Path(work_dir) / "slice")
        checked = {"model": str(model_dir), "what": size.describe(), **asdict(size)}
        print(f"checking {size.describe()}", flush=True)
    model_dir = ranks.agree(str(model_dir) if ranks.writer else None)
    settings = {"dtype": dtype, "mem_fraction_static": 0.5}
    if device == "cpu":
        # The KV cache is capped by max_total_tokens: the fraction only has to leave SGLang's check of the
        # free memory room for other processes (0.05 failed the start when they took 5% meanwhile).
        settings["server_args"] = {"max_total_tokens": 4 * max_batch_tokens}
    settings = fill_defaults(settings, "hidden_states.sglang")
    flags = server_flags(model_dir, settings, trust_remote_code, max_batch_tokens, dist.get_world_size())
    runner = SGLangModelRunner([*flags, *(CPU_SERVER_FLAGS if device == "cpu" else ())], rank=rank, gpu_id=local_rank)
    batch = random_batch(runner.hf_config.vocab_size, samples, hi=min(512, max_batch_tokens))
    ours = {
        final: capture_in_batches(SGLangCapture(runner, "auto", final, ranks), batch, max_batch_tokens)
        for final in ("normed", "raw")
    }
    if not ranks.writer:
        return True, {}
    rows: list[LayerAgreement] = []
    hf_settings = {"dtype": dtype, "device": device}
    for final, states in ours.items():
        reference = HFCapture(model_dir, "auto", final, hf_settings, trust_remote_code)
        expected = capture_in_batches(reference, batch, max_batch_tokens)
        compared = agreement_by_layer(states, expected, reference.aux_layers, final)
        rows += compared if final == "normed" else compared[-1:]  # auxiliary layers do not depend on `final`
    table = format_table(rows)
    records = as_records(rows)
    ok = all(r.ok for r in rows)
    if url:
        prompts = [ids[:64] for ids in batch[:8]]
        if launch_args is not None:
            launch = fill_defaults({"args": list(launch_args)}, "inference.sglang.launch")
            with launched_server(model_dir, url, launch, Path(work_dir) / "server.log"):
                generated = generate_agreement(url, model_dir, prompts, new_tokens, hf_settings)
        else:
            generated = generate_agreement(url, model_dir, prompts, new_tokens, hf_settings)
        table += "\n" + generated.row()
        records.append({"layer": "generate", **asdict(generated), "ok": generated.ok})
        ok = ok and generated.ok
    print(table, flush=True)
    return ok, {"checked": checked, "layers": records}


def node_gpu_bytes() -> int:
    """The memory of every GPU this process sees (under torchrun: the node's)."""
    return sum(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
