"""What the GPU check loads (diagnostics/model_slice.py): the whole model where one copy fits 40% of the
GPUs' memory, else the first 7 layers, as a directory of links that transformers loads with the same
states as the whole model's first layers (SGLang loading a slice: tests/real_sglang/test_gpu_check.py)."""

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from eagle3_datagen.diagnostics.model_slice import CheckSize, check_size, size_check, write_slice
from eagle3_datagen.formats.checkpoint import tensor_bytes
from tests.helpers import tiny_qwen3

GIB, GB = 2**30, 10**9
H200_MIB, H100_MIB = 143771, 81559  # nvidia-smi's memory.total


def kimi_k25_sizes() -> dict[str, int]:
    """Kimi-K2.5's checkpoint, ~600 GB, by part (its names as in a multimodal checkpoint): a 163,840 x 7,168
    bf16 embedding and head, a dense first layer, 60 MoE layers of 384 INT4 experts, a vision tower."""
    embedding = 163840 * 7168 * 2
    sizes = {
        "language_model.model.embed_tokens.weight": embedding,
        "language_model.lm_head.weight": embedding,
        "language_model.model.norm.weight": 7168 * 2,
        "vision_tower.encoder.blocks.0.mlp.fc0.weight": 900 * 10**6,
        "language_model.model.layers.0.mlp.down_proj.weight": 1_600 * 10**6,
    }
    sizes |= {f"language_model.model.layers.{i}.mlp.experts.weight_packed": 9_700 * 10**6 for i in range(1, 61)}
    sizes["language_model.model.layers.61.mlp.experts.weight_packed"] = 9_700 * 10**6  # the MTP layer
    return sizes


def test_kimi_k25_on_eight_gpus_is_checked_on_its_first_seven_layers():
    sizes = kimi_k25_sizes()
    assert 595 * GB < sum(sizes.values()) < 600 * GB
    for gpu_mib in (H200_MIB, H100_MIB):
        size = size_check(sizes, 61, 8 * gpu_mib * 2**20)
        assert (size.layers, size.model_layers, size.whole) == (7, 61, False)
        # the embedding, head, norm and vision tower, layer 0, six MoE layers
        assert size.bytes == 2 * 163840 * 7168 * 2 + 7168 * 2 + 900 * 10**6 + 1_600 * 10**6 + 6 * 9_700 * 10**6
    said = size_check(sizes, 61, 8 * H200_MIB * 2**20).describe()
    assert said == (
        "the first 7 of 61 layers (65.4 GB of the checkpoint's 598.9 GB per engine; "
        "one copy is over 40% of the GPUs' 1206 GB)"
    )


def test_a_model_one_copy_of_which_fits_forty_percent_is_checked_whole():
    # Llama-3.1-8B's ~16 GB in bf16: on one H100 both copies fit
    sizes = {"model.embed_tokens.weight": 1 * GB, "lm_head.weight": 1 * GB}
    sizes |= {f"model.layers.{i}.mlp.weight": 437 * 10**6 for i in range(32)}
    size = size_check(sizes, 32, H100_MIB * 2**20)
    assert size.whole and size.bytes == size.checkpoint_bytes == 2 * GB + 32 * 437 * 10**6
    assert size.describe() == "the whole model, 32 layers (16.0 GB of the checkpoint's 16.0 GB per engine)"
    assert size_check(sizes, 32, None).whole  # no GPU memory known (the CPU): the whole model
    assert size_check(sizes, 32, None, layers=7).layers == 7  # as told


def test_a_slice_that_does_not_fit_either_is_refused_with_its_sizes():
    with pytest.raises(ValueError, match=r"even 7 layers \(65.4 GB\) are over 40% of the GPUs' 86 GB"):
        size_check(kimi_k25_sizes(), 61, H100_MIB * 2**20)


def test_the_slice_loads_in_transformers_with_the_whole_models_first_layers(tmp_path):
    """A tiny Qwen3 of 8 layers saved in small shards: the 7-layer slice links only the shards its tensors
    are in, and its states are the whole model's hidden_states[0..6] (its final, the norm of index 7)."""
    torch.manual_seed(0)
    whole = tiny_qwen3(64, num_layers=8).eval()
    whole.save_pretrained(tmp_path / "model", max_shard_size="20KB")
    shards = sorted(p.name for p in (tmp_path / "model").glob("*.safetensors"))
    sliced = write_slice(tmp_path / "model", 7, tmp_path / "slice")
    index = json.loads((sliced / "model.safetensors.index.json").read_text())["weight_map"]
    assert not [n for n in index if n.startswith("model.layers.7.")] and "model.layers.6.mlp.up_proj.weight" in index
    assert "lm_head.weight" in index and "model.norm.weight" in index
    linked = sorted(p.name for p in sliced.glob("*.safetensors"))
    assert linked == sorted(set(index.values())) and len(linked) < len(shards)
    assert all((sliced / name).resolve() == (tmp_path / "model" / name).resolve() for name in linked)
    assert json.loads((sliced / "config.json").read_text())["num_hidden_layers"] == 7

    ids = torch.tensor([[1, 5, 9, 33, 2, 61, 17]])
    with torch.inference_mode():
        full = whole(ids, output_hidden_states=True).hidden_states
        part = AutoModelForCausalLM.from_pretrained(sliced, dtype=torch.float32).eval()
        ours = part(ids, output_hidden_states=True).hidden_states
    assert len(ours) == 8
    for i in range(7):
        assert torch.equal(ours[i], full[i]), i
    assert torch.allclose(ours[7], whole.model.norm(full[7]), atol=1e-6)

    size = check_size(tmp_path / "model", None, layers=7)
    sizes = tensor_bytes(tmp_path / "model")
    assert size.checkpoint_bytes == sum(sizes.values()) == sum(p.numel() * 4 for p in whole.state_dict().values())
    assert size.bytes == sum(b for n, b in sizes.items() if not n.startswith("model.layers.7."))


def test_a_multimodal_checkpoint_is_cut_in_its_text_config_and_keeps_its_vision_tower(tmp_path):
    """Kimi-K2.5's layout: the language model's settings under `text_config`, its tensors under
    `language_model.`; a vision tower's numbered blocks are not decoder layers."""
    model = tmp_path / "model"
    model.mkdir()
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "text_config": {"num_hidden_layers": 9}}
    (model / "config.json").write_text(json.dumps(config))
    (model / "tiktoken.model").write_text("stand-in")
    layers = [f"language_model.model.layers.{i}.w" for i in range(10)]
    names = ["language_model.model.embed_tokens.weight", "language_model.lm_head.weight",
             "vision_tower.encoder.layers.8.weight", *layers]  # fmt: skip
    save_file({n: torch.zeros(2) for n in names}, model / "model.safetensors")
    sliced = write_slice(model, 7, tmp_path / "slice")
    written = json.loads((sliced / "config.json").read_text())
    assert written["text_config"] == {"num_hidden_layers": 7} and "num_hidden_layers" not in written
    kept = json.loads((sliced / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(kept) == sorted(
        n for n in names if not n.startswith(tuple(f"language_model.model.layers.{i}." for i in (7, 8, 9)))
    )
    assert (sliced / "tiktoken.model").resolve() == model / "tiktoken.model"
    # the 10th layer (an MTP layer) is no decoder layer: the whole model loads 12 of the 13 tensors
    assert check_size(model, None) == CheckSize(9, 9, 12 * 8, 13 * 8, None)
