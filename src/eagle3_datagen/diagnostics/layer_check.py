"""The stored layers of a few samples against an independent capture, at the published layer convention.

The probe checks the final state with the model's own LM head; reversed or shifted auxiliary layers
and a missing final norm pass it, and they are the field's commonest silent failure (layer-id
off-by-ones: TorchSpec #87, speculators #705; a missing final norm: speculators PR #313, vLLM #46973).
This check shares no code with the capture: plain transformers (`output_hidden_states`, the model
loaded here), the layers named by EAGLE-3's published convention (hidden_states indices [2, N//2, N-3],
the embedding output being 0: [2, 30, 58] for Kimi-K2.5's 61 layers; the configured list where the
config names one), and the final layer before its norm and after it. It compares, slot by slot, what
the pipeline stored: the hidden-state shard (aux slots, and the final as `hidden_states.final` says),
the SpecForge export (`aux_hidden_state`, and `hidden_state`, which must be after the final norm) and
the speculators export (aux slots, then the final before the norm, which speculators applies itself).
A slot that matches none of them is named with the layer it does match best (a reversed list shows as
slot 0 matching layer N-3).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from eagle3_datagen.formats.files import read_jsonl
from eagle3_datagen.formats.hidden_shard import HiddenShard
from eagle3_datagen.formats.trainer_exports import EXPORTS

# A stored slot agrees with the independent capture within storage precision (bf16: about 0.4% relative
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


def independent_capture(model_dir: str | Path, samples: list[list[int]], trust_remote_code: bool) -> dict:
    """Per sample, every hidden_states index and the final layer before and after the norm, from plain
    transformers (on the GPUs, bf16, where there are some; float32 on the CPU)."""
    from transformers import AutoModelForCausalLM

    cuda = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        dtype=torch.bfloat16 if cuda else torch.float32,
        device_map="auto" if cuda else None,
        trust_remote_code=trust_remote_code,
    ).eval()
    # transformers replaces hidden_states[N] by the normed last state unless told not to
    model.config.tie_last_hidden_states = False
    base = model.get_decoder()
    out = []
    with torch.inference_mode():
        for ids in samples:
            run = base(input_ids=torch.tensor([ids], device=model.device), output_hidden_states=True)
            layers = [h[0].float().cpu() for h in run.hidden_states]
            out.append({"layers": layers, "raw": layers[-1], "normed": run.last_hidden_state[0].float().cpu()})
    return {"num_layers": model.config.num_hidden_layers, "samples": out}


def _references(captured: dict, index: int) -> dict[str, torch.Tensor]:
    sample = captured["samples"][index]
    refs = {f"hidden_states[{i}]": layer for i, layer in enumerate(sample["layers"][:-1])}
    return refs | {"final, raw": sample["raw"], "final, normed": sample["normed"]}


def _slots(where: str, aux: torch.Tensor, final: torch.Tensor, expected_aux: list[int], final_kind: str) -> list:
    """(where, slot, expected name, stored tensor) of one sample's aux [T, A*H] and final [T, H]."""
    width = final.shape[-1]
    slots = [
        (where, f"aux {k}", f"hidden_states[{layer}]", aux[..., k * width : (k + 1) * width])
        for k, layer in enumerate(expected_aux)
    ]
    return [*slots, (where, "final", f"final, {final_kind}", final)]


def compare(captured: dict, stored: list[list[tuple]]) -> list[Slot]:
    """Each sample's stored slots (from `_slots`) against its references; the worst of the samples per slot."""
    worst: dict[tuple[str, str], Slot] = {}
    for index, slots in enumerate(stored):
        refs = _references(captured, index)
        for where, slot, expected, tensor in slots:
            cosine, rel_err = _agreement(tensor, refs[expected])
            best = max(refs, key=lambda name: _agreement(tensor, refs[name])[0] - _agreement(tensor, refs[name])[1])
            row = Slot(where, slot, expected, cosine, rel_err, best)
            key = (where, slot)
            if key not in worst or (row.cosine, -row.rel_err) < (worst[key].cosine, -worst[key].rel_err):
                worst[key] = row
    return list(worst.values())


def stored_slots(hidden_dir: Path, exports: dict[str, Path], ids: list[str], expected_aux: list[int]) -> list[list]:
    """What the pipeline stored for the samples `ids`: the shard's slots and each export's."""
    shard = HiddenShard(hidden_dir)
    final_kind = shard.index["final"]
    per_sample = []
    for sid in ids:
        sample = shard.sample(sid)
        slots = _slots("hidden shard", sample["aux_hidden_states"], sample["hidden_states"], expected_aux, final_kind)
        per_sample.append(slots)
    for fmt, export in exports.items():
        rows = {r["id"]: r["index"] for r in read_jsonl(export / "ids.jsonl")}
        for slots, sid in zip(per_sample, ids, strict=True):
            if sid not in rows:
                continue  # held out of the exports
            export_entry = EXPORTS[fmt]
            aux, final = export_entry.read_slots(export, rows[sid])
            slots += _slots(f"{fmt} export", aux, final, expected_aux, export_entry.final_slot)
    return per_sample


def check_layers(
    model_dir: str | Path,
    hidden_dir: str | Path,
    exports: dict[str, Path],
    aux_spec,
    samples: int,
    trust_remote_code: bool,
) -> tuple[bool, list[dict]]:
    """The `samples` shortest samples of a shard that both exports hold, checked slot by slot; returns
    (every slot agrees, one row per stored slot)."""
    shard = HiddenShard(hidden_dir)
    exported = set.intersection(*[{r["id"] for r in read_jsonl(e / "ids.jsonl")} for e in exports.values()] or [set()])
    lengths = {s["id"]: len(s["input_ids"]) for s in shard.iter_samples(("input_ids",))}
    chosen = sorted(lengths, key=lambda sid: (sid not in exported, lengths[sid], sid))[:samples]
    ids = [[int(t) for t in shard.sample(sid, ("input_ids",))["input_ids"]] for sid in chosen]
    captured = independent_capture(model_dir, ids, trust_remote_code)
    num_layers = captured["num_layers"]
    expected = published_aux_layers(num_layers) if aux_spec == "auto" else [int(i) for i in aux_spec]
    rows = compare(captured, stored_slots(Path(hidden_dir), exports, chosen, expected))
    return all(r.ok for r in rows), [{**asdict(r), "ok": r.ok} for r in rows]


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'stored':<20} {'slot':<6} {'must hold':<18} {'min_cos':>8} {'rel_err':>8}  verdict"]
    for r in rows:
        verdict = "ok" if r["ok"] else f"MISMATCH (matches {r['best_match']})"
        lines.append(
            f"{r['where']:<20} {r['slot']:<6} {r['expected']:<18} {r['cosine']:>8.4f} {r['rel_err']:>8.4f}  {verdict}"
        )
    return "\n".join(lines)


def write_rows(path: str | Path, ok: bool, rows: list[dict]) -> None:
    Path(path).write_text(json.dumps({"ok": ok, "slots": rows}, indent=2) + "\n")
