"""The speculators export: the directory vLLM speculators 0.9.0's `speculators train --data-path` reads.

An Arrow dataset (`datasets.save_to_disk`, torch format) of `input_ids`, `loss_mask` and `seq_len`
rows in export order, and `hidden_states/hs_{i}.safetensors` for row i with `token_ids` [L] and
`hidden_states` [L, A+1, H] (auxiliary layers in order, then layer N before the final norm:
speculators applies the verifier's norm to that slot itself); README.md with the command, whose
`--d2t-path` / `--t2d-path` name the vocab stage's d2t.npy / t2d.npy when there is one.

fp8 shards with scales per token or per channel stay fp8: `hidden_states` float8 with
`hidden_states_scales` (float32, [L, A+1, 1] or [1, A+1, H]), which speculators 0.9.0's `fp8` hidden-states
backend (hs_connectors 0.9.0's `FP8Transfer`: `values.to(bf16) * scales.to(bf16)`, broadcast) turns into
the same bf16 states our reader dequantizes; the command then names `--hidden-states-backend fp8`. Block
scales do not broadcast over a row: those shards are exported dequantized to bf16.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save as safetensors_bytes

from eagle3_datagen.formats.checksums import ALGORITHM
from eagle3_datagen.formats.hidden_shard import HiddenShard
from eagle3_datagen.formats.trainer_exports import EXPORTS
from eagle3_datagen.stages.export.files import ExportFiles

SPECULATORS_RELEASE = "speculators==0.9.0"
# hs_connectors' key for fp8 scales (hs_connectors/fp8_utils.py SCALES_KEY)
SCALES_KEY = "hidden_states_scales"
KEEPS_FP8 = EXPORTS["speculators"].files.fp8_scales  # scale layouts that broadcast over [L, A+1, H]


def _speculators(sample: dict, aux_layers: int) -> dict:
    length, hidden = sample["hidden_states"].shape
    aux = sample["aux_hidden_states"].reshape(length, aux_layers, hidden)
    tensors = {
        "token_ids": sample["input_ids"].long(),
        "hidden_states": torch.cat([aux, sample["hidden_states"].unsqueeze(1)], dim=1).contiguous(),
    }
    if "hidden_states_scale" in sample:
        aux_scale, final_scale = sample["aux_hidden_states_scale"], sample["hidden_states_scale"]
        if aux_scale.dim() == 2:  # per token and layer: [L, A] and [L, 1]
            scales = torch.cat([aux_scale, final_scale], dim=1).unsqueeze(-1)
        else:  # per channel over the part: [A * H] and [H]
            scales = torch.cat([aux_scale.reshape(aux_layers, hidden), final_scale.unsqueeze(0)]).unsqueeze(0)
        tensors[SCALES_KEY] = scales.float().contiguous()
    return tensors


def speculators_command(
    out_dir: Path,
    model_path: str | Path,
    aux_layers: list[int],
    vocab_dir: Path | None,
    draft_vocab: int | None,
    fp8: bool = False,
) -> str:
    """The `speculators train` command that trains an EAGLE-3 draft on this export (`fp8`: its states
    are stored fp8, read through speculators' `fp8` hidden-states backend)."""
    args = [
        "speculators",
        "train",
        "--speculator-type",
        "eagle3",
        "--verifier-name-or-path",
        str(model_path),
        "--data-path",
        str(out_dir),
        "--target-layer-ids",
        *map(str, aux_layers),
        "--on-missing",
        "raise",
    ]
    if fp8:
        args += ["--hidden-states-backend", "fp8"]
    if vocab_dir is not None and draft_vocab is not None:
        args += ["--draft-vocab-size", str(draft_vocab)]
        args += ["--d2t-path", str(vocab_dir / "d2t.npy"), "--t2d-path", str(vocab_dir / "t2d.npy")]
    return shlex.join([*args, "--save-path", "checkpoints/eagle3"])


def _speculators_dataset(files: ExportFiles, rows: dict[str, list[np.ndarray]]) -> None:
    """The Arrow rows speculators' `ArrowDataset` loads with `datasets.load_from_disk`."""
    import datasets  # only this exporter needs it

    lengths = np.array([len(ids) for ids in rows["input_ids"]], dtype=np.int64)
    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int64")),
            "loss_mask": datasets.Sequence(datasets.Value("int64")),
            "seq_len": datasets.Value("int64"),
        }
    )
    table = {"input_ids": [r.tolist() for r in rows["input_ids"]], "loss_mask": [r.tolist() for r in rows["loss_mask"]]}
    dataset = datasets.Dataset.from_dict({**table, "seq_len": lengths.tolist()}, features=features)
    dataset.set_format(type="torch")
    dataset.save_to_disk(str(files.root))
    for path in sorted(files.root.iterdir()):
        if path.is_file() and path.suffix in (".arrow", ".json"):
            files.record(path.name)


def _readme(command: str, summary: dict) -> bytes:
    stored = (
        f"The states are stored {summary['dtype']} with float32 scales (`{SCALES_KEY}`); speculators' `fp8` "
        "hidden-states backend dequantizes them to bf16 as it reads.\n\n"
        if summary["dtype"].startswith("float8")
        else ""
    )
    return (
        f"# EAGLE-3 training data for vLLM speculators ({SPECULATORS_RELEASE})\n\n"
        f"{summary['samples']} samples, {summary['tokens']} tokens, auxiliary layers {summary['aux_layers']} "
        "(transformers `hidden_states` indices) and layer N's output before the final norm in the last slot "
        "(speculators applies the verifier's final norm itself).\n\n"
        f"{stored}"
        "Train (add `--epochs`, `--lr`, `--total-seq-len` as needed; `speculators train --help`):\n\n"
        f"```bash\n{command}\n```\n\n"
        f"`export.json` lists the {ALGORITHM} checksum of every file here; `ids.jsonl` maps row i to its sample id.\n"
    ).encode()


class SpeculatorsExport:
    """Rows and files of one speculators export (`export.export` drives it); it has no settings of its
    own (`settings`: {})."""

    def __init__(
        self,
        shards: list[HiddenShard],
        model_path: str | Path | None,
        vocab_dir: str | Path | None,
        draft_vocab_size: int | None,
        settings: dict,
    ):
        index = shards[0].index if shards else {"aux_layers": [], "final": "raw"}
        if index["final"] == "normed":
            raise ValueError(
                f"{shards[0].path} stores final: normed; speculators applies the verifier's final norm itself and "
                "would norm it twice. Capture with hidden_states.final: raw."
            )
        self.aux_layers = index["aux_layers"]
        self.model_path = model_path
        self.vocab_dir = Path(vocab_dir) if vocab_dir else None
        self.draft_vocab_size = draft_vocab_size
        # fp8 stays fp8 where every shard is fp8 with scales that broadcast over a row; else it is dequantized
        self.stored_states = bool(shards) and all(s.codec.fp8 and s.codec.scales in KEEPS_FP8 for s in shards)
        exported = {s.codec.dtype if self.stored_states or not s.codec.fp8 else "bfloat16" for s in shards}
        self.dtype = "/".join(sorted(exported))  # the states' element type(s) in the files
        self._rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def add(self, files: ExportFiles, number: int, sample: dict) -> None:
        """Write one sample's states file (from any thread) and keep its Arrow row."""
        files.write(
            f"hidden_states/hs_{number}.safetensors", safetensors_bytes(_speculators(sample, len(self.aux_layers)))
        )
        ids, mask = sample["input_ids"].numpy().astype(np.int64), sample["loss_mask"].numpy().astype(np.int64)
        self._rows[number] = (ids, mask)

    def finish(self, files: ExportFiles, out_dir: Path, summary: dict) -> dict:
        """The Arrow rows of the samples `add` wrote, then the files beside them (`side_files`)."""
        rows = [self._rows[number] for number in range(len(self._rows))]
        _speculators_dataset(files, {"input_ids": [r[0] for r in rows], "loss_mask": [r[1] for r in rows]})
        return self.side_files(files, out_dir, summary)

    def side_files(self, files: ExportFiles, out_dir: Path, summary: dict) -> dict:
        """The README with the training command; returns what export.json records."""
        command = speculators_command(
            out_dir,
            self.model_path or "VERIFIER_DIR",
            self.aux_layers,
            self.vocab_dir,
            self.draft_vocab_size,
            fp8=self.stored_states,
        )
        # The last slot as exported: layer N before the norm; speculators norms it itself.
        added = {
            "final_norm_applied": False,
            "trainer": SPECULATORS_RELEASE,
            "command": command,
            "dtype": self.dtype,
        }
        files.write("README.md", _readme(command, {**summary, **added}))
        return added
