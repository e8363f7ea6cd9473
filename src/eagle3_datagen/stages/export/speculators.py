"""The speculators export: the directory vLLM speculators 0.9.0's `speculators train --data-path` reads.

An Arrow dataset (`datasets.save_to_disk`, torch format) of `input_ids`, `loss_mask` and `seq_len`
rows in export order, and `hidden_states/hs_{i}.safetensors` for row i with `token_ids` [L] and
`hidden_states` [L, A+1, H] (auxiliary layers in order, then layer N before the final norm:
speculators applies the verifier's norm to that slot itself); README.md with the command, whose
`--d2t-path` / `--t2d-path` name the vocab stage's d2t.npy / t2d.npy when there is one.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save as safetensors_bytes

from eagle3_datagen.formats.checksums import ALGORITHM
from eagle3_datagen.formats.hidden_shard import HiddenShard
from eagle3_datagen.stages.export.files import ExportFiles

SPECULATORS_RELEASE = "speculators==0.9.0"


def _speculators(sample: dict, aux_layers: int) -> dict:
    length, hidden = sample["hidden_states"].shape
    aux = sample["aux_hidden_states"].reshape(length, aux_layers, hidden)
    return {
        "token_ids": sample["input_ids"].long(),
        "hidden_states": torch.cat([aux, sample["hidden_states"].unsqueeze(1)], dim=1).contiguous(),
    }


def speculators_command(
    out_dir: Path, model_path: str | Path, aux_layers: list[int], vocab_dir: Path | None, draft_vocab: int | None
) -> str:
    """The `speculators train` command that trains an EAGLE-3 draft on this export."""
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
    return (
        f"# EAGLE-3 training data for vLLM speculators ({SPECULATORS_RELEASE})\n\n"
        f"{summary['samples']} samples, {summary['tokens']} tokens, auxiliary layers {summary['aux_layers']} "
        "(transformers `hidden_states` indices) and layer N's output before the final norm in the last slot "
        "(speculators applies the verifier's final norm itself).\n\n"
        "Train (add `--epochs`, `--lr`, `--total-seq-len` as needed; `speculators train --help`):\n\n"
        f"```bash\n{command}\n```\n\n"
        f"`export.json` lists the {ALGORITHM} checksum of every file here; `ids.jsonl` maps row i to its sample id.\n"
    ).encode()


class SpeculatorsExport:
    """Rows and files of one speculators export (`export.export` drives it)."""

    def __init__(
        self,
        shards: list[HiddenShard],
        model_path: str | Path | None,
        vocab_dir: str | Path | None,
        draft_vocab_size: int | None,
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
        self.rows: dict[str, list[np.ndarray]] = {"input_ids": [], "loss_mask": []}

    def add(self, files: ExportFiles, number: int, sample: dict) -> None:
        files.write(
            f"hidden_states/hs_{number}.safetensors", safetensors_bytes(_speculators(sample, len(self.aux_layers)))
        )
        self.rows["input_ids"].append(sample["input_ids"].numpy().astype(np.int64))
        self.rows["loss_mask"].append(sample["loss_mask"].numpy().astype(np.int64))

    def finish(self, files: ExportFiles, out_dir: Path, summary: dict) -> dict:
        _speculators_dataset(files, self.rows)
        command = speculators_command(
            out_dir, self.model_path or "VERIFIER_DIR", self.aux_layers, self.vocab_dir, self.draft_vocab_size
        )
        # The last slot as exported: layer N before the norm; speculators norms it itself.
        added = {"final_norm_applied": False, "trainer": SPECULATORS_RELEASE, "command": command}
        files.write("README.md", _readme(command, {**summary, **added}))
        return added
