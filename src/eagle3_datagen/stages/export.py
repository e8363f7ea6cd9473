"""Exporters from packed hidden-state shards to the layouts trainers read.

- `specforge`: SpecForge's offline layout, one `torch.save` dict per sample in
  `rows_{a}-{b}/data_{i}.ckpt` with `input_ids` [L], `loss_mask` [L], `hidden_state`
  [1, L, H] (the final layer) and `aux_hidden_state` [1, L, A*H].
- `speculators`: the directory vLLM speculators 0.9.0's `speculators train --data-path` reads: an
  Arrow dataset (`datasets.save_to_disk`, torch format) of `input_ids`, `loss_mask` and `seq_len`
  rows in export order, and `hidden_states/hs_{i}.safetensors` for row i with `token_ids` [L] and
  `hidden_states` [L, A+1, H] (auxiliary layers in order, then layer N before the final norm:
  speculators applies the verifier's norm to that slot itself); README.md with the command, whose
  `--d2t-path` / `--t2d-path` name the vocab stage's d2t.npy / t2d.npy when there is one.

Both number samples in shard order, write `ids.jsonl` (index -> sample id) so no sample loses its
source id, and record in `export.json` the final-slot convention and the xxh3-64 checksum of every
file they wrote (hashed from the bytes as written); the directory appears only when complete.
Every part read is checked against its shard's checksum first (`HiddenShard`).
"""

from __future__ import annotations

import io
import shlex
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import torch
from safetensors.torch import save as safetensors_bytes

from eagle3_datagen.formats.checksums import ALGORITHM, digest, file_digest
from eagle3_datagen.formats.files import atomic_dir, write_json
from eagle3_datagen.formats.hidden_shard import HiddenShard

FORMATS = ("specforge", "speculators")
SPECFORGE_ROWS_PER_DIR = 1000
SPECULATORS_RELEASE = "speculators==0.9.0"


class _Files:
    """Writes files under an export directory and keeps the checksum of each one's bytes."""

    def __init__(self, root: Path):
        self.root = root
        self.checksums: dict[str, str] = {}

    def write(self, relative: str, data: bytes) -> None:
        path = self.root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        self.checksums[relative] = digest(data)

    def record(self, relative: str) -> None:
        """A file another library wrote (the Arrow dataset: ids and masks only, small)."""
        self.checksums[relative] = file_digest(self.root / relative)


def _shards(shard_dirs: list[str | Path]) -> list[HiddenShard]:
    shards = [HiddenShard(d) for d in shard_dirs]
    layouts = {(tuple(s.index["aux_layers"]), s.index["final"], s.index["hidden_size"]) for s in shards}
    if len(layouts) > 1:
        raise ValueError(f"shards {list(shard_dirs)} store different layouts {sorted(layouts)}; recapture them alike")
    return shards


def _samples(shards: list[HiddenShard]) -> Iterator[dict]:
    for shard in shards:
        yield from shard


def _specforge(sample: dict) -> dict:
    return {
        "input_ids": sample["input_ids"].long(),
        "loss_mask": sample["loss_mask"].long(),
        "hidden_state": sample["hidden_states"].unsqueeze(0).contiguous(),
        "aux_hidden_state": sample["aux_hidden_states"].unsqueeze(0).contiguous(),
    }


def _speculators(sample: dict, aux_layers: int) -> dict:
    length, hidden = sample["hidden_states"].shape
    aux = sample["aux_hidden_states"].reshape(length, aux_layers, hidden)
    return {
        "token_ids": sample["input_ids"].long(),
        "hidden_states": torch.cat([aux, sample["hidden_states"].unsqueeze(1)], dim=1).contiguous(),
    }


def speculators_command(
    out_dir: Path, model_path: str | Path, aux_layers: list[int], vocab_dir: str | Path | None, draft_vocab: int | None
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
    if draft_vocab is not None:
        args += ["--draft-vocab-size", str(draft_vocab)]
        args += ["--d2t-path", str(Path(vocab_dir) / "d2t.npy"), "--t2d-path", str(Path(vocab_dir) / "t2d.npy")]
    return shlex.join([*args, "--save-path", "checkpoints/eagle3"])


def _speculators_dataset(files: _Files, rows: dict[str, list[np.ndarray]]) -> None:
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


def export(
    shard_dirs: list[str | Path],
    out_dir: str | Path,
    fmt: str,
    vocab_dir: str | Path | None = None,
    model_path: str | Path | None = None,
    draft_vocab_size: int | None = None,
) -> dict:
    """Write `shard_dirs`' samples in order to `out_dir` in `fmt`'s layout. The speculators command
    names `model_path` (the verifier) and the vocab stage's `vocab_dir`/d2t.npy and t2d.npy of
    `draft_vocab_size` entries (named, not copied: one partition's change then reruns only its export)."""
    if fmt not in FORMATS:
        raise ValueError(f"export format must be one of {FORMATS}, not {fmt!r}")
    shards = _shards(shard_dirs)
    index = shards[0].index if shards else {"aux_layers": [], "final": "raw", "hidden_size": 0}
    if fmt == "speculators" and index["final"] == "normed":
        raise ValueError(
            f"{shard_dirs[0]} stores final: normed; speculators applies the verifier's final norm itself and would "
            "norm it twice. Capture with hidden_states.final: raw."
        )
    aux_layers = len(index["aux_layers"])
    out_dir = Path(out_dir)
    count = tokens = 0
    rows: dict[str, list[np.ndarray]] = {"input_ids": [], "loss_mask": []}
    with atomic_dir(out_dir) as tmp:
        files = _Files(tmp)
        ids = io.BytesIO()
        for number, sample in enumerate(_samples(shards)):
            if fmt == "specforge":
                start = number - number % SPECFORGE_ROWS_PER_DIR
                buffer = io.BytesIO()
                torch.save(_specforge(sample), buffer)
                files.write(f"rows_{start}-{start + SPECFORGE_ROWS_PER_DIR}/data_{number}.ckpt", buffer.getvalue())
            else:
                data = safetensors_bytes(_speculators(sample, aux_layers))
                files.write(f"hidden_states/hs_{number}.safetensors", data)
                rows["input_ids"].append(sample["input_ids"].numpy().astype(np.int64))
                rows["loss_mask"].append(sample["loss_mask"].numpy().astype(np.int64))
            ids.write(orjson.dumps({"index": number, "id": sample["id"]}) + b"\n")
            count += 1
            tokens += len(sample["input_ids"])
        files.write("ids.jsonl", ids.getvalue())
        summary = {
            "format": fmt,
            "samples": count,
            "tokens": tokens,
            "shards": [str(d) for d in shard_dirs],
            "aux_layers": index["aux_layers"],
            "final": index["final"],
            # The last slot as exported: speculators gets layer N before the norm and norms it itself.
            "final_norm_applied": index["final"] == "normed",
        }
        if fmt == "speculators":
            _speculators_dataset(files, rows)
            command = speculators_command(
                out_dir, model_path or "VERIFIER_DIR", index["aux_layers"], vocab_dir, draft_vocab_size
            )
            summary.update(trainer=SPECULATORS_RELEASE, command=command)
            files.write("README.md", _readme(command, summary))
        summary.update(checksum=ALGORITHM, files=files.checksums)
        write_json(tmp / "export.json", summary)
    return {k: v for k, v in summary.items() if k != "files"}
