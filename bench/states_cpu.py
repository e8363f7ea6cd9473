#!/usr/bin/env python
"""The CPU side of the hidden states at Kimi-K2.5's width: capture's writes, the exports, the trainers' reads.

States: Kimi-K2.5's layout (hidden 7168, 3 auxiliary layers + the final one, bf16: 57,349 bytes a token
with ID and mask), synthetic, since no Kimi weights are here: per layer, normal values times a log-normal
scale per channel (sigma 0.5) and per token (sigma 0.3), with a few channels 100x larger (the massive
activations of real models' auxiliary layers). What makes bf16 states compress is the entropy of the
high byte (sign and exponent) against a near-random low byte; these give zstd_planes about 0.72 of bf16
at level 3, inside the 0.70-0.80 measured on real 7168-wide states (facts.md), where the tiny models'
states compress to 0.42-0.70.

Sections (all by default; each prints one JSON object):
- `capture`: `capture_shard` over a stand-in capture that returns the states at once, so the stage's
  time is all encoding, compression, checksum and writing, per storage setting, with a writer pool of 1
  and 2 threads (`hidden_states.writer_threads`): CPU seconds (every thread's), bytes/s per core (bf16
  bytes), wall-time scaling from 1 to 2 threads, and the cores the CPU side needs at --target tokens/s.
- `overlap`: the same with forward passes that take a fixed time without the CPU (what a GPU forward
  leaves the host: the stand-in sleeps), at --forward-share of the 2-thread pool's rate (or at
  --forward-tokens-per-s), so that the CPU side can keep up: stage time over the forward passes' time
  (1.0: the CPU is hidden; what is left is the last part's write, one part's time of the shard's).
- `export`: the exports of the zstd_planes shard (SpecForge plain and gzipped, speculators) on 1 and 2
  threads: CPU seconds per bf16 byte, wall scaling, bytes on disk per token and their ratio to bf16.
- `zstd`: zstd's multithreaded mode (`threads=1` and 2: one frame cut in jobs) against the single-threaded
  frame the codec writes, level 3, on the first --zstd-mb MB of the states as safetensors bytes and as byte
  planes: CPU MB/s per core (best of 3) and whether the frames are the single-threaded one's bytes.
- `read`: what a trainer pays to read a sample: SpecForge 0.2.0's own `load_feature_file` on `.ckpt`
  and `.ckpt.gz` (in .venv-specforge, when built), safetensors' `load_file` on a speculators file, and
  our reader decoding the shard's parts, each per core (every tensor touched).

Usage: python bench/states_cpu.py [--tokens 8192] [--sample-tokens 512] [--part-mb 64] [--hidden 7168]
       [--sections capture overlap export read zstd] [--work DIR]
"""

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import datasets  # noqa: F401 (imported before timing: the speculators export writes its rows with it)
import torch
import zstandard
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

from eagle3_datagen.backends.base import SingleProcess
from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.formats.hidden_codec import byte_planes
from eagle3_datagen.formats.hidden_shard import HiddenShard
from eagle3_datagen.stages.export import export
from eagle3_datagen.stages.hidden.shard import capture_shard

REPO = Path(__file__).resolve().parents[1]
AUX_LAYERS = [2, 30, 58]  # Kimi-K2.5's (61 layers): EAGLE-3's auto choice
STORAGE = {
    "none": {"dtype": "bfloat16", "compress": "none"},
    "zstd": {"dtype": "bfloat16", "compress": "zstd"},
    "zstd_planes": {"dtype": "bfloat16", "compress": "zstd_planes"},
    "zstd_planes level 1": {"dtype": "bfloat16", "compress": "zstd_planes", "compress_level": 1},
    "fp8 token zstd": {"dtype": "float8_e4m3", "scales": "token", "compress": "zstd", "reference_positions": 0},
}
SPECFORGE_READ = """
import json, sys, time
from specforge.runtime.data_plane.feature_store import load_feature_file
paths = sys.argv[1:]
start = time.process_time()
for path in paths:
    sample = load_feature_file(path)
    sum(float(t.float().sum()) for t in sample.values())  # touch every byte (a .ckpt is memory-mapped)
print(json.dumps({"cpu_s": time.process_time() - start}))
"""


def synthetic_states(tokens: int, layers: int, hidden: int, generator: torch.Generator) -> torch.Tensor:
    """bf16 [tokens, layers * hidden]: normal values scaled per channel and per token, a few massive channels."""
    channels = torch.exp(torch.randn(layers * hidden, generator=generator) * 0.5)
    per_token = torch.exp(torch.randn(tokens, 1, generator=generator) * 0.3)
    states = torch.randn(tokens, layers * hidden, generator=generator) * channels * per_token
    massive = [c for c in (3, hidden + 17, 2 * hidden + 40) if c < layers * hidden]
    states[:, massive] *= 100.0
    return states.bfloat16()


class StandInCapture:
    """A capture backend whose forward passes return prepared states after `seconds_per_token` x tokens of
    sleep (a GPU forward: the host waits, its cores idle). No GPU here: it stands in for one."""

    packed = True
    ranks = SingleProcess()
    model_name = "synthetic-kimi-k2.5-layout"
    num_layers = 61
    aux_layers = AUX_LAYERS
    final = "raw"

    def __init__(self, states: dict[int, tuple[torch.Tensor, torch.Tensor]], hidden: int):
        self.states = states
        self.hidden_size = hidden
        self.seconds_per_token = 0.0
        self.forward_seconds = 0.0

    def __call__(self, batch: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        wait = self.seconds_per_token * sum(len(ids) for ids in batch)
        time.sleep(wait)
        self.forward_seconds += wait
        return [self.states[ids[0]] for ids in batch]  # each sample's first ID names it


def make_samples(count: int, tokens: int, hidden: int) -> tuple[list[dict], dict]:
    generator = torch.Generator().manual_seed(0)
    samples, states = [], {}
    for n in range(count):
        ids = [n] + [7] * (tokens - 1)
        samples.append(
            {"id": f"s{n}", "input_ids": ids, "loss_mask": [0] * (tokens // 2) + [1] * (tokens - tokens // 2)}
        )
        states[n] = (synthetic_states(tokens, 3, hidden, generator), synthetic_states(tokens, 1, hidden, generator))
    return samples, states


def timed(fn, *args, **kwargs):
    """fn's result, wall seconds and CPU seconds (this process: every thread's)."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - wall, time.process_time() - cpu


def hidden_settings(storage: dict, part_mb: int, threads: int) -> dict:
    return fill_defaults(
        {"aux_layers": AUX_LAYERS, "shard_bytes": part_mb << 20, "max_batch_tokens": 1 << 30,
         "writer_threads": threads, **storage},
        "hidden_states",
    )  # fmt: skip


def capture_section(samples, capture, args, bf16: int, tokens: int, work: Path) -> dict:
    results = {}
    for name, storage in STORAGE.items():
        row, seconds = {}, {}
        for threads in (1, 2):
            out = work / f"{name}-{threads}".replace(" ", "_")
            index, wall, cpu = timed(
                capture_shard, samples, out, capture, hidden_settings(storage, args.part_mb, threads)
            )
            row[threads] = {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "ratio": round(index["bytes"] / bf16, 4)}
            seconds[threads] = (wall, cpu)
        per_core = bf16 / seconds[1][1]
        row["bf16_MB_per_s_per_core"] = round(per_core / 1e6)
        row["scaling_1_to_2_threads"] = round(seconds[1][0] / seconds[2][0], 2)
        row["cores_at_target"] = round(args.target * bf16 / tokens / per_core, 1)
        results[name] = row
    return results


def overlap_section(samples, capture, args, tokens: int, work: Path, cpu_side_tokens_per_s: float) -> dict:
    capture.seconds_per_token = 1 / (args.forward_share * cpu_side_tokens_per_s)
    capture.forward_seconds = 0.0
    settings = hidden_settings(STORAGE["zstd_planes"], args.part_mb, 2)
    index, wall, _ = timed(capture_shard, samples, work / "overlap", capture, settings)
    capture.seconds_per_token = 0.0
    return {
        "setting": "zstd_planes",
        "load_average_1min": round(os.getloadavg()[0], 2),  # other processes on the cores: the ratio is then higher
        "writer_threads": 2,
        "parts": len(index["parts"]),
        "forward_tokens_per_s": round(args.forward_share * cpu_side_tokens_per_s),
        "forward_s": round(capture.forward_seconds, 2),
        "stage_s": round(wall, 2),
        "stage_over_forward": round(wall / max(capture.forward_seconds, 1e-9), 3),
    }


def export_section(shard: Path, bf16: int, tokens: int, work: Path) -> dict:
    results = {}
    variants = {
        "specforge": ("specforge", {}),
        "specforge gzip 1": ("specforge", {"specforge": {"compress": "gzip", "compress_level": 1}}),
        "speculators": ("speculators", {}),
    }
    for name, (fmt, settings) in variants.items():
        row, seconds = {}, {}
        for threads in (1, 2):
            out = work / f"export-{name}-{threads}".replace(" ", "_")
            summary, wall, cpu = timed(
                export, [shard], out, fmt, model_path=work / "model", settings=fill_defaults(settings, "export"),
                threads=threads,
            )  # fmt: skip
            row[threads] = {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3)}
            seconds[threads] = (wall, cpu)
            row["bytes_per_token"] = round(summary["bytes"] / tokens, 1)
            row["ratio_to_bf16"] = round(summary["bytes"] / bf16, 4)
        row["bf16_MB_per_s_per_core"] = round(bf16 / seconds[1][1] / 1e6)
        row["scaling_1_to_2_threads"] = round(seconds[1][0] / seconds[2][0], 2)
        results[name] = row
    return results


def read_section(shard: Path, bf16: int, work: Path) -> dict:
    results = {}
    hidden = HiddenShard(shard)
    _, _, cpu = timed(lambda: [hidden.part_samples(k) for k in range(len(hidden.index["parts"]))])
    results["shard parts (zstd_planes), our reader"] = {"bf16_MB_per_s_per_core": round(bf16 / max(cpu, 1e-6) / 1e6)}
    states = sorted((work / "export-speculators-1" / "hidden_states").glob("hs_*.safetensors"))
    _, _, cpu = timed(lambda: [float(t.float().sum()) for p in states for t in load_file(p).values()])
    results["speculators hs_i.safetensors, load_file"] = {"bf16_MB_per_s_per_core": round(bf16 / max(cpu, 1e-6) / 1e6)}
    python = REPO / ".venv-specforge" / "bin" / "python"
    for name, directory in (("plain", "export-specforge-1"), ("gzip 1", "export-specforge_gzip_1-1")):
        rows = sorted(str(p) for p in (work / directory).glob("rows_*/*"))
        if not python.exists():
            results[f"SpecForge load_feature_file, {name}"] = "not run: make specforge-env"
            continue
        out = subprocess.run([str(python), "-c", SPECFORGE_READ, *rows], capture_output=True, text=True, check=True)
        cpu = json.loads(out.stdout.splitlines()[-1])["cpu_s"]
        results[f"SpecForge load_feature_file, {name}"] = {"bf16_MB_per_s_per_core": round(bf16 / max(cpu, 1e-6) / 1e6)}
    return results


def zstd_section(samples: list[dict], states: dict, megabytes: int) -> dict:
    """CPU MB/s a core of zstd level 3 single-threaded (the codec's frame) and in its multithreaded mode."""
    rows, size = [], 0
    for sample in samples:
        rows.append(states[sample["input_ids"][0]][0])
        size += rows[-1].numel() * 2
        if size >= megabytes * 1e6:
            break
    aux = torch.cat(rows)
    results = {"MB": round(size / 1e6)}
    for name, tensor in (("bf16 states", aux), ("byte planes", byte_planes(aux))):
        data = safetensors_bytes({"x": tensor})
        single = zstandard.ZstdCompressor(level=3).compress(data)
        row = {}
        for mode, kwargs in (("single-threaded", {}), ("threads=1", {"threads": 1}), ("threads=2", {"threads": 2})):
            compressor = zstandard.ZstdCompressor(level=3, **kwargs)
            frame, best = None, None
            for _ in range(3):
                frame, _, cpu = timed(compressor.compress, data)
                best = cpu if best is None else min(best, cpu)
            row[mode] = {"MB_per_s_per_core": round(len(data) / best / 1e6), "same_bytes_as_single": frame == single}
        results[name] = row
    return results


def write_model(path: Path, hidden: int) -> None:
    """A checkpoint of only what the SpecForge export reads: config, final norm, LM head and embedding (tiny
    vocabulary), with its index."""
    from safetensors.torch import save_file

    from eagle3_datagen.formats.checkpoint import write_safetensors_index

    path.mkdir(parents=True)
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": hidden,
              "num_hidden_layers": 61, "rms_norm_eps": 1e-6, "vocab_size": 16, "num_attention_heads": 64}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    tensors = {
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "lm_head.weight": torch.zeros(16, hidden, dtype=torch.bfloat16),
        "model.embed_tokens.weight": torch.zeros(16, hidden, dtype=torch.bfloat16),
    }
    save_file(tensors, path / "model.safetensors")
    write_safetensors_index(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192, help="tokens captured per run")
    p.add_argument("--sample-tokens", type=int, default=512)
    p.add_argument("--part-mb", type=int, default=64, help="hidden_states.shard_bytes, in MiB")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--target", type=float, default=40_000, help="tokens/s the node's forward passes capture")
    p.add_argument("--forward-share", type=float, default=0.8, help="forward rate as a share of the CPU side's")
    p.add_argument(
        "--forward-tokens-per-s", type=float, help="the overlap's forward rate (default: --forward-share of capture's)"
    )
    p.add_argument("--sections", nargs="+", default=["capture", "overlap", "export", "read", "zstd"])
    p.add_argument("--zstd-mb", type=int, default=88, help="the zstd section's bytes of states")
    p.add_argument("--work", type=Path, help="where files are written (default: a temporary directory)")
    args = p.parse_args()
    torch.set_num_threads(1)
    count = max(1, args.tokens // args.sample_tokens)
    samples, states = make_samples(count, args.sample_tokens, args.hidden)
    capture = StandInCapture(states, args.hidden)
    tokens = count * args.sample_tokens
    bf16 = tokens * (4 * args.hidden * 2 + 5)
    print(json.dumps({"tokens": tokens, "samples": count, "hidden": args.hidden, "bf16_bytes": bf16}))
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        work = Path(tmp)
        cpu_side = None
        if "capture" in args.sections:
            captured = capture_section(samples, capture, args, bf16, tokens, work)
            print(json.dumps({"capture": captured}, indent=2))
            cpu_side = tokens / max(captured["zstd_planes"][2]["wall_s"], 1e-3)
        if "overlap" in args.sections and (cpu_side or args.forward_tokens_per_s):
            rate = args.forward_tokens_per_s / args.forward_share if args.forward_tokens_per_s else cpu_side
            print(json.dumps({"overlap": overlap_section(samples, capture, args, tokens, work, rate)}, indent=2))
        if {"export", "read"} & set(args.sections):
            shard = work / "export-source"
            capture_shard(samples, shard, capture, hidden_settings(STORAGE["zstd_planes"], args.part_mb, 2))
            write_model(work / "model", args.hidden)
            print(json.dumps({"export": export_section(shard, bf16, tokens, work)}, indent=2))
            if "read" in args.sections:
                print(json.dumps({"read": read_section(shard, bf16, work)}, indent=2))
    if "zstd" in args.sections:
        print(json.dumps({"zstd": zstd_section(samples, states, args.zstd_mb)}, indent=2))


if __name__ == "__main__":
    main()
