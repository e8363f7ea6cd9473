"""The SpecForge export: SpecForge 0.2.0's offline layout and what its `specforge train` needs beside it.

Its `OfflineManifestReader` lists every `*.ckpt` and `*.ckpt.gz` under the directory, sorted: one
`torch.save` dict per sample in `rows_{a:09d}-{b:09d}/data_{i:09d}.ckpt` (zero-padded, so that sorted
order is export order and SpecForge's file index is our sample number) with `input_ids` [L],
`loss_mask` [L], `hidden_state` [1, L, H] (the final layer after the final norm: SpecForge's target
head is the bare LM head) and `aux_hidden_state` [1, L, A*H]; with `export.specforge.compress: gzip`
each is gzipped (`.ckpt.gz`, which its `load_feature_file` decompresses whole before `torch.load`).
Beside them the draft config, the vocabulary mapping, a ready `specforge train` config and a README
(`SpecForgeExport`).
"""

from __future__ import annotations

import gzip
import io
import json
import threading
from pathlib import Path

import torch
import yaml

from eagle3_datagen.chat.families.target_chat import family_for_model_type
from eagle3_datagen.formats.checkpoint import FinalNorm, head_and_norm_names, one_named, tensor_files, text_config
from eagle3_datagen.formats.draft_vocab import VOCAB_MAPPING
from eagle3_datagen.formats.hidden_shard import HiddenShard
from eagle3_datagen.stages.export.files import ExportFiles

SPECFORGE_ROWS_PER_DIR = 1000
SPECFORGE_RELEASE = "specforge==0.2.0"
SPECFORGE_NAME_DIGITS = 9  # names sort in export order up to 10^9 samples
# The target config keys SpecForge 0.2.0 copies into a draft config it generates
# (`specforge.training.model_loading._TARGET_ARCHITECTURE_FIELDS`).
SPECFORGE_DRAFT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "hidden_act",
    "initializer_range",
    "attention_bias",
    "attention_dropout",
    "head_dim",
    "rope_theta",
    "rope_scaling",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
)


def specforge_sample_path(index: int, gzipped: bool = False) -> str:
    start = index - index % SPECFORGE_ROWS_PER_DIR
    digits = SPECFORGE_NAME_DIGITS
    name = f"rows_{start:0{digits}d}-{start + SPECFORGE_ROWS_PER_DIR:0{digits}d}/data_{index:0{digits}d}.ckpt"
    return name + ".gz" if gzipped else name


class SpecForgeExport:
    """SpecForge's files for one export: the sample rows, and what its `specforge train` needs beside them.

    One capture serves both trainers: a shard stored `final: raw` (layer N before the final norm)
    gets the final norm applied here (RMSNorm with the checkpoint's weight and `rms_norm_eps`, in
    float32, cast back to the stored dtype), since SpecForge's target head applies none; a shard
    stored `final: normed` is exported as it is. Every shard must share one layout (one draft config).
    SpecForge 0.2.0 reads no fp8: fp8 shards are exported dequantized to bf16. `settings`: the validated
    `export.specforge` section (`compress`: none or gzip, at `compress_level`).
    """

    stored_states = False  # samples come dequantized: SpecForge reads bf16 (or the stored fp16/fp32)

    def __init__(
        self,
        shards: list[HiddenShard],
        model_path: str | Path | None,
        vocab_dir: str | Path | None,
        draft_vocab_size: int | None,
        settings: dict,
    ):
        if model_path is None:
            raise ValueError("the specforge export needs the target model directory (--model)")
        indexes = {str(s.path): s.index for s in shards}
        layouts = {(tuple(i["aux_layers"]), i["final"], i["hidden_size"], i["num_layers"]) for i in indexes.values()}
        if len(layouts) > 1:
            raise ValueError(
                f"shards {sorted(indexes)} store different layouts (aux_layers, final, hidden_size, num_layers): "
                f"{sorted(layouts)}; one SpecForge export needs one layout: recapture the odd shards"
            )
        first = next(iter(indexes.values()))
        self.aux_layers = list(first["aux_layers"])
        if len(self.aux_layers) != 3:
            raise ValueError(
                f"SpecForge 0.2.0's EAGLE-3 draft reads exactly 3 auxiliary layers; the shards store "
                f"{self.aux_layers}: set hidden_states.aux_layers to 3 layers (or auto) and recapture"
            )
        self.model_path = Path(model_path).resolve()
        # The ids SGLang serving the draft captures these layers with: most families count from the
        # layer output (id i - 1 for hidden_states[i]); DeepSeek's shift only ids that start at 1.
        family = family_for_model_type(text_config(self.model_path).get("model_type", ""))
        self.sglang_layer_ids = family.sglang_layer_ids(self.aux_layers)
        # results/vocab's vocab_mapping.pt, named in specforge.yaml (not copied: results/vocab combines
        # every partition, and a copy would rerun every export when one partition changes)
        self.vocab_dir = Path(vocab_dir).resolve() if vocab_dir else None
        self.draft_vocab_size = draft_vocab_size
        self.final_norm = FinalNorm(self.model_path) if first["final"] == "raw" else None
        files = tensor_files(self.model_path)
        self.lm_head_key = head_and_norm_names(self.model_path, files)[0]
        self.embedding_key = one_named(list(files), "embed_tokens.weight")
        settings = settings or {"compress": "none"}
        self.gzip_level = settings["compress_level"] if settings["compress"] == "gzip" else None
        self._rows = {"raw_bytes": 0, "bytes": 0}
        self._lock = threading.Lock()

    def add(self, files: ExportFiles, number: int, sample: dict) -> None:
        """Write one sample's row (from any thread)."""
        buffer = io.BytesIO()
        torch.save(self.sample(sample), buffer)
        data = raw = buffer.getvalue()
        if self.gzip_level is not None:
            data = gzip.compress(raw, compresslevel=self.gzip_level, mtime=0)  # no time stamp: the same bytes each run
        files.write(specforge_sample_path(number, self.gzip_level is not None), data)
        with self._lock:
            self._rows["raw_bytes"] += len(raw)
            self._rows["bytes"] += len(data)

    def sample(self, sample: dict) -> dict:
        """One `.ckpt` row. Every tensor is a copy: `torch.save` of a view writes its whole part."""
        final = sample["hidden_states"]
        final = self.final_norm(final) if self.final_norm else final.clone()
        return {
            "input_ids": sample["input_ids"].long(),
            "loss_mask": sample["loss_mask"].long(),
            "hidden_state": final.unsqueeze(0),
            "aux_hidden_state": sample["aux_hidden_states"].clone().unsqueeze(0),
        }

    def draft_config(self) -> dict:
        """The draft config SpecForge would generate from the target, with our draft vocabulary and layers.

        `eagle_aux_hidden_state_layer_ids` counts as SGLang does for the target's family (for most, layer
        i's output is id i - 1, our hidden_states index i: `chat.families`), so SGLang serving the trained
        draft captures the layers it was trained on."""
        target = text_config(self.model_path)
        config = {key: target[key] for key in SPECFORGE_DRAFT_FIELDS if target.get(key) is not None}
        if "head_dim" not in config and "qk_rope_head_dim" in target:
            # SpecForge reads the target through AutoConfig: DeepSeek-V3's config sets head_dim so.
            config["head_dim"] = target["qk_rope_head_dim"]
        rope = config.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type")) == "yarn" and "mscale" not in rope:
            # gpt-oss's YaRN names no mscale: SpecForge 0.2.0's draft passes the absent keys on as None and
            # fails; these two give its YaRN transformers' default attention factor, 0.1 ln(factor) + 1.
            config["rope_scaling"] = {**rope, "mscale": 1.0, "mscale_all_dim": 0.0}
        config.update(
            architectures=["LlamaForCausalLMEagle3"],
            model_type="llama",
            num_hidden_layers=1,
            tie_word_embeddings=False,
            use_cache=True,
            eagle_config={"eagle_aux_hidden_state_layer_ids": self.sglang_layer_ids},
        )
        config.setdefault("pad_token_id", 0)
        if self.draft_vocab_size is not None:
            config["draft_vocab_size"] = self.draft_vocab_size
        return config

    def train_config(self, out_dir: Path) -> dict:
        """A `specforge train` config for this export on one node (paths as they will be after the rename)."""
        model = {
            "target_model_path": str(self.model_path),
            "draft_model_config": str(out_dir / "draft_config.json"),
            "lm_head_key": self.lm_head_key,
            "embedding_key": self.embedding_key,
        }
        if self.vocab_dir:
            model["vocab_mapping_path"] = str(self.vocab_dir / VOCAB_MAPPING)
        return {
            "model": model,
            "data": {"hidden_states_path": str(out_dir), "cache_dir": str(out_dir.parent / "specforge-cache")},
            "training": {"strategy": "eagle3"},
            "output_dir": str(out_dir.parent / "specforge-draft"),
        }

    def finish(self, files: ExportFiles, out_dir: Path, summary: dict) -> dict:
        """The files beside the rows (`side_files`): SpecForge's rows are all written by `add`."""
        return self.side_files(files, out_dir, summary)

    def side_files(self, files: ExportFiles, out_dir: Path, summary: dict) -> dict:
        """Write the draft config, vocabulary mapping, train config and README; returns what export.json records."""
        files.write("draft_config.json", (json.dumps(self.draft_config(), indent=2, sort_keys=True) + "\n").encode())
        files.write("specforge.yaml", yaml.safe_dump(self.train_config(out_dir), sort_keys=False).encode())
        files.write("README.md", _specforge_readme(out_dir, self).encode())
        return {
            "trainer": SPECFORGE_RELEASE,
            "final_norm_applied": self.final_norm is not None,
            "aux_layers": self.aux_layers,
            "specforge_aux_layer_ids": self.sglang_layer_ids,
            # the rows' bytes before and after compression: the plan's observed gzip ratio
            "rows": {"compress": "gzip" if self.gzip_level else "none", "level": self.gzip_level, **self._rows},
        }


def _specforge_readme(out_dir: Path, sf: SpecForgeExport) -> str:
    index_note = (
        ""
        if list(sf.model_path.glob("*.index.json"))
        else (
            f"\n**{sf.model_path} has no `*.index.json`**: SpecForge 0.2.0's target head finds the LM head only "
            f"through one. For a checkpoint saved as one `model.safetensors`, write it with\n`python -c "
            f"\"from eagle3_datagen.formats.checkpoint import write_safetensors_index as w; w('{sf.model_path}')\"`.\n"
        )
    )
    vocab_note = (
        f"`specforge.yaml`'s `vocab_mapping_path` names the workflow's draft vocabulary, "
        f"{sf.vocab_dir / VOCAB_MAPPING}."
        if sf.vocab_dir
        else "No `vocab_mapping.draft_vocab_size` was configured: SpecForge derives its own mapping at its "
        "default draft vocabulary (32,000)."
    )
    gz = ".gz" if sf.gzip_level else ""
    gz_note = (
        "\n  Gzipped: SpecForge's loader threads (`data.dataloader_num_workers`, 4 per rank by default) each "
        "decompress a whole row before `torch.load`; raise them if the GPUs wait on data."
        if sf.gzip_level
        else ""
    )
    norm = (
        "applied here (the shards store layer N before the final norm)"
        if sf.final_norm
        else "as stored (the shards store the final norm's output)"
    )
    return f"""# SpecForge export ({SPECFORGE_RELEASE})

Train an EAGLE-3 draft on this directory with SpecForge's own CLI, on one node:

```bash
specforge train --config {out_dir}/specforge.yaml
```

Add dotted overrides for the run (`training.num_epochs=2 training.batch_size=4
deployment.trainer.nproc_per_node=8`), or to point at moved files (`model.target_model_path=...
data.hidden_states_path=... model.draft_model_config=... model.vocab_mapping_path=...`).

- `rows_*/data_*.ckpt{gz}`: one sample each, numbered as in `ids.jsonl` (SpecForge's file index).{gz_note}
  `hidden_state` is the final layer after the target's final norm, {norm}; `aux_hidden_state` holds
  hidden_states layers {sf.aux_layers} (SpecForge/SGLang ids {sf.sglang_layer_ids}).
- `draft_config.json`: SpecForge's generated draft config with this draft vocabulary and
  `eagle_config.eagle_aux_hidden_state_layer_ids`. {vocab_note}
- `specforge.yaml`: the target checkpoint, `lm_head_key`/`embedding_key` as its tensors are named.
{index_note}"""
