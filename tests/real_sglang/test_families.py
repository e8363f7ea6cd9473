"""The target families' architectures in SGLang 0.5.23 on the CPU: the auxiliary-layer ids each family's
registry entry writes into a draft config (`Family.sglang_layer_ids`) make SGLang's own
`set_eagle3_layers_to_capture` capture the layers the draft was trained on, and SGLang's model runner
captures Qwen3-MoE's states equal to transformers' (scripts/gpu_check.py, as the GPU node runs it).
gpt-oss does not run here: SGLang 0.5.23's GptOssForCausalLM asserts an attention backend with sinks
(triton, fa3, intel_amx, ...), none of which has a CPU build on PyPI."""

import importlib
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagle3_datagen.chat.families import family_for_model_type
from eagle3_datagen.chat.template import load_tokenizer
from eagle3_datagen.targets.tiny_family import tiny_config, tiny_model, write_model_dir

REPO = Path(__file__).resolve().parents[2]
TARGETS = REPO / "tests" / "fixtures" / "targets"
ARCHITECTURES = [
    ("sglang.srt.models.qwen3", "Qwen3ForCausalLM", "qwen3"),
    ("sglang.srt.models.qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe"),
    ("sglang.srt.models.llama", "LlamaForCausalLM", "llama"),
    ("sglang.srt.models.gpt_oss", "GptOssForCausalLM", "gpt_oss"),
    ("sglang.srt.models.deepseek_v2", "DeepseekV3ForCausalLM", "deepseek_v3"),
]


class DecoderStack:
    """Where SGLang's causal-LM classes leave the capture list (Qwen3-MoE's sets it through a method)."""

    layers_to_capture: list[int] = []

    def set_eagle3_layers_to_capture(self, layers: list[int]) -> None:
        self.layers_to_capture = list(layers)


@pytest.mark.parametrize(("module", "cls", "model_type"), ARCHITECTURES)
@pytest.mark.parametrize("aux_layers", [[2, 4, 5], [3, 5, 6], [4, 5, 6]])
def test_a_familys_draft_layer_ids_make_sglang_capture_its_layers(module, cls, model_type, aux_layers):
    """SGLang's own method, called on a stand-in for the model object (a real one needs a model runner per
    process, which the capture tests build for Qwen3 and DeepSeek-V3): it sets the decoder stack's inputs to
    capture, which are hidden_states indices."""
    model = SimpleNamespace(
        pp_group=SimpleNamespace(is_last_rank=True), config=SimpleNamespace(num_hidden_layers=8), model=DecoderStack()
    )
    ids = family_for_model_type(model_type).sglang_layer_ids(aux_layers)
    getattr(importlib.import_module(module), cls).set_eagle3_layers_to_capture(model, ids)
    assert model.model.layers_to_capture == aux_layers, (model_type, ids)


TINY = {"seed": 0, "hidden_size": 32, "intermediate_size": 64, "num_layers": 8, "num_heads": 4, "num_kv_heads": 2}
MOE = {"routed_experts": 4, "experts_per_token": 2, "shared_experts": 0, "intermediate_size": 16}


# Llama 3.1's tiny model passes the same check (docs/targets.md); left out here for the tier's time: its
# dense attention and MLP are Qwen3's, which test_capture.py checks.
@pytest.mark.parametrize(("folder", "architecture"), [("qwen3", "qwen3_moe")])
def test_sglang_captures_the_architecture_as_transformers_computes_it(folder, architecture, tmp_path):
    settings = {**TINY, "architecture": architecture, "tokenizer": str(TARGETS / folder), "moe": MOE}
    config = tiny_config(settings, load_tokenizer(TARGETS / folder))
    write_model_dir(tmp_path / "model", tiny_model(config, seed=1).eval(), config, TARGETS / folder, {})
    out = tmp_path / "check.json"
    proc = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
            str(REPO / "scripts" / "gpu_check.py"), "--device", "cpu", "--dtype", "float32",
            "--model", str(tmp_path / "model"), "--samples", "4", "--max-batch-tokens", "64", "--out", str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = json.loads(out.read_text())
    assert records["ok"] and [r["layer"] for r in records["layers"]][:3] == [
        "aux hidden_states[2]",
        "aux hidden_states[4]",
        "aux hidden_states[5]",
    ]
    assert all(r["ok"] and r["max_abs"] < 1e-4 and r["min_cosine"] > 0.9999 for r in records["layers"]), records
