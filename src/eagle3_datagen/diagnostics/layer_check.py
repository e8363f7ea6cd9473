"""The stored layers of a few samples against every layer the capture runner's hooks recorded.

The probe checks the final state with the model's own LM head; reversed or shifted auxiliary layers
and a missing final norm pass it, and they are the field's commonest silent failure (layer-id
off-by-ones: TorchSpec #87, speculators #705; a missing final norm: speculators PR #313, vLLM #46973).
The references come from `stages/hidden/layer_tap.py`: hooks on every decoder layer and the final norm
of the model the capture runner loaded (no second load), named by module order alone, written beside
the shard (`{shard}.layers.safetensors`, `hidden_states.layer_check_samples`). The layers a slot must
hold come from EAGLE-3's published convention, not from the capture's code (hidden_states indices
[2, N//2, N-3], the embedding output being 0: [2, 30, 58] for Kimi-K2.5's 61 layers; the configured
list where the config names one). This compares, slot by slot at the recorded positions, what the
pipeline stored: the hidden-state shard (aux slots, and the final as `hidden_states.final` says), the
SpecForge export (`aux_hidden_state`, and `hidden_state`, which must be after the final norm) and the
speculators export (aux slots, then the final before the norm, which speculators applies itself). A
slot that matches none of them is named with the layer it does match best (a reversed list shows as
slot 0 matching layer N-3).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from eagle3_datagen.formats.files import read_jsonl
from eagle3_datagen.formats.hidden_shard import HiddenShard
from eagle3_datagen.formats.trainer_exports import EXPORTS

# A stored slot agrees with the recorded layer within storage precision (bf16: about 0.4% relative
# error, fp8 with scales a few percent); a wrong layer or a missing norm is far outside it.
MIN_COSINE = 0.99
MAX_REL_ERR = 0.1


def published_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's auxiliary layers as published (hidden_states indices; SGLang/TRT-LLM count them one lower)."""
    return [2, num_layers // 2, num_layers - 3]


@dataclass
class Slot:
    where: str  # "hidden shard", "specforge export", "speculators export"
    slot: str  # "aux 0", ..., "final"
    expected: str  # what it must hold: "hidden_states[2]", "final, raw", "final, normed"
    cosine: float
    rel_err: float
    best_match: str  # the reference it agrees with best

    @property
    def ok(self) -> bool:
        return self.cosine >= MIN_COSINE and self.rel_err <= MAX_REL_ERR


def _agreement(stored: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    a, b = stored.float().flatten(0, -2), reference.float().flatten(0, -2)
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item()
    return cosine, ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def read_tap(path: str | Path) -> dict[str, dict[str, torch.Tensor]]:
    """The layers `layer_tap.record_layers` wrote: per sample id, `positions` and each named reference."""
    from safetensors.torch import load_file

    tap: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(path)).items():
        sid, name = key.split("/", 1)
        tap.setdefault(sid, {})[name] = tensor
    return tap


def num_layers(tap: dict) -> int:
    """N, the decoder layers the hooks saw (hidden_states[1..N])."""
    names = next(iter(tap.values()))
    return max(int(n.removeprefix("hidden_states[").rstrip("]")) for n in names if n.startswith("hidden_states["))


def _references(tap: dict, sid: str) -> dict[str, torch.Tensor]:
    return {name: t for name, t in tap[sid].items() if name != "positions"}


def _slots(where: str, aux: torch.Tensor, final: torch.Tensor, expected_aux: list[int], final_kind: str) -> list:
    """(where, slot, expected name, stored tensor) of one sample's aux [T, A*H] and final [T, H]."""
    width = final.shape[-1]
    slots = [
        (where, f"aux {k}", f"hidden_states[{layer}]", aux[..., k * width : (k + 1) * width])
        for k, layer in enumerate(expected_aux)
    ]
    return [*slots, (where, "final", f"final, {final_kind}", final)]


def compare(tap: dict, stored: dict[str, list[tuple]]) -> list[Slot]:
    """Each sample's stored slots (from `stored_slots`) at the recorded positions against its references;
    the worst of the samples per slot."""
    worst: dict[tuple[str, str], Slot] = {}
    for sid, slots in stored.items():
        refs, positions = _references(tap, sid), tap[sid]["positions"]
        for where, slot, expected, stored_tensor in slots:
            tensor = stored_tensor[positions]
            cosine, rel_err = _agreement(tensor, refs[expected])
            best = max(refs, key=lambda name: _agreement(tensor, refs[name])[0] - _agreement(tensor, refs[name])[1])
            row = Slot(where, slot, expected, cosine, rel_err, best)
            key = (where, slot)
            if key not in worst or (row.cosine, -row.rel_err) < (worst[key].cosine, -worst[key].rel_err):
                worst[key] = row
    return list(worst.values())


def stored_slots(hidden_dir: Path, exports: dict[str, Path], ids: list[str], expected_aux: list[int]) -> dict:
    """What the pipeline stored for the samples `ids`: per id, the shard's slots and each export's."""
    shard = HiddenShard(hidden_dir)
    final_kind = shard.index["final"]
    per_sample = {}
    for sid in ids:
        sample = shard.sample(sid)
        aux, final = sample["aux_hidden_states"], sample["hidden_states"]
        per_sample[sid] = _slots("hidden shard", aux, final, expected_aux, final_kind)
    for fmt, export in exports.items():
        rows = {r["id"]: r["index"] for r in read_jsonl(export / "ids.jsonl")}
        export_entry = EXPORTS[fmt]
        for sid in ids:
            if sid in rows:  # else held out of the exports
                aux, final = export_entry.read_slots(export, rows[sid])
                per_sample[sid] += _slots(f"{fmt} export", aux, final, expected_aux, export_entry.final_slot)
    return per_sample


def check_layers(
    tap_path: str | Path, hidden_dir: str | Path, exports: dict[str, Path], aux_spec
) -> tuple[bool, list[dict]]:
    """The samples the capture runner recorded every layer of (`tap_path`), checked slot by slot in the
    shard and the `exports` that hold them; returns (every slot agrees, one row per stored slot)."""
    tap = read_tap(tap_path)
    expected = published_aux_layers(num_layers(tap)) if aux_spec == "auto" else [int(i) for i in aux_spec]
    rows = compare(tap, stored_slots(Path(hidden_dir), exports, sorted(tap), expected))
    return all(r.ok for r in rows), [{**asdict(r), "ok": r.ok} for r in rows]


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'stored':<20} {'slot':<6} {'must hold':<18} {'min_cos':>8} {'rel_err':>8}  verdict"]
    for r in rows:
        verdict = "ok" if r["ok"] else f"MISMATCH (matches {r['best_match']})"
        lines.append(
            f"{r['where']:<20} {r['slot']:<6} {r['expected']:<18} {r['cosine']:>8.4f} {r['rel_err']:>8.4f}  {verdict}"
        )
    return "\n".join(lines)
