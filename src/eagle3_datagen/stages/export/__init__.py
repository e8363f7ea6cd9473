"""Stage: exporters from packed hidden-state shards to the layouts the trainers' releases read.

- `speculators` (`speculators.py`): the directory vLLM speculators 0.9.0's `speculators train
  --data-path` reads: an Arrow dataset of `input_ids`, `loss_mask` and `seq_len` rows in export
  order, `hidden_states/hs_{i}.safetensors` (auxiliary layers, then layer N before the final norm:
  speculators applies the verifier's norm itself), `d2t.npy` / `t2d.npy`, README.md with the command.
- `specforge` (`specforge.py`): SpecForge 0.2.0's offline rows, one `torch.save` dict per sample
  (the final layer after the final norm: SpecForge's target head is the bare LM head), with the
  draft config, the vocabulary mapping, a ready `specforge train` config and a README.

Both leave out the evaluation's held-out samples (`held_out`: their prompt ids, formats/holdout.py),
number the rest in shard order, write `ids.jsonl` (index -> sample id) so no sample loses its
source id, and record in `export.json` the final-slot convention and the xxh3-64 checksum of every
file they wrote (hashed from the bytes as written); the directory appears only when complete.
Every part read is checked against its shard's checksum first (`HiddenShard`).
"""

from __future__ import annotations

import io
from collections.abc import Collection, Iterator
from pathlib import Path

import orjson

from eagle3_datagen.formats.checksums import ALGORITHM
from eagle3_datagen.formats.files import atomic_dir, write_json
from eagle3_datagen.formats.hidden_shard import HiddenShard
from eagle3_datagen.stages.export.files import ExportFiles
from eagle3_datagen.stages.export.specforge import SpecForgeExport
from eagle3_datagen.stages.export.speculators import SpeculatorsExport

FORMATS = ("specforge", "speculators")


def _shards(shard_dirs: list[str | Path]) -> list[HiddenShard]:
    shards = [HiddenShard(d) for d in shard_dirs]
    layouts = {(tuple(s.index["aux_layers"]), s.index["final"], s.index["hidden_size"]) for s in shards}
    if len(layouts) > 1:
        raise ValueError(f"shards {list(shard_dirs)} store different layouts {sorted(layouts)}; recapture them alike")
    return shards


def _samples(shards: list[HiddenShard], held_out: Collection[str]) -> Iterator[dict]:
    for shard in shards:
        for sample in shard:
            if sample["id"] not in held_out:
                yield sample


def export(
    shard_dirs: list[str | Path],
    out_dir: str | Path,
    fmt: str,
    *,
    model_path: str | Path | None = None,
    vocab_dir: str | Path | None = None,
    draft_vocab_size: int | None = None,
    held_out: Collection[str] = (),
) -> dict:
    """Write `shard_dirs`' samples in order to `out_dir` in `fmt`'s layout. `model_path` is the target
    (verifier) model directory: SpecForge's export reads its final norm, LM head and config, and both
    name it in their training command; `vocab_dir` is the vocab stage's directory, whose d2t/t2d (of
    `draft_vocab_size` entries) the exports name, not copy: one partition's change then reruns only
    its own export. Samples whose id is in `held_out` (the evaluation's) are not exported."""
    if fmt not in FORMATS:
        raise ValueError(f"export format must be one of {FORMATS}, not {fmt!r}")
    shards = _shards(shard_dirs)
    index = shards[0].index if shards else {"aux_layers": [], "final": "raw", "hidden_size": 0}
    kind = SpecForgeExport if fmt == "specforge" else SpeculatorsExport
    writer = kind(shards, model_path, vocab_dir, draft_vocab_size)
    out_dir = Path(out_dir)
    held_out = set(held_out)
    count = tokens = 0
    with atomic_dir(out_dir) as tmp:
        files = ExportFiles(tmp)
        ids = io.BytesIO()
        for number, sample in enumerate(_samples(shards, held_out)):
            writer.add(files, number, sample)
            ids.write(orjson.dumps({"index": number, "id": sample["id"]}) + b"\n")
            count += 1
            tokens += len(sample["input_ids"])
        files.write("ids.jsonl", ids.getvalue())
        summary = {
            "format": fmt,
            "samples": count,
            # the samples left out for the evaluation (some held-out prompts may have no sample)
            "held_out": sum(len(s) for s in shards) - count,
            "tokens": tokens,
            "shards": [str(d) for d in shard_dirs],
            "aux_layers": index["aux_layers"],
            "final": index["final"],
        }
        summary.update(writer.finish(files, out_dir.resolve(), summary))
        summary.update(checksum=ALGORITHM, files=files.checksums)
        write_json(tmp / "export.json", summary)
    return {k: v for k, v in summary.items() if k != "files"}
