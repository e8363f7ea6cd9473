"""A self-consistency probe of stored hidden-state shards, with the target model's own LM head.

For every loss-masked token at position j (a token the draft model will be trained to
predict), the LM head is applied to the stored final-layer state at j - 1 (after the final
norm when the shard stores `final: raw`) and its prediction compared with the stored token:
top-1 agreement, mean log-probability of the stored token, and the share outside the top 5.
On greedy data with exact output IDs, agreement is near 1.0 by construction; a loss mask
misaligned with the IDs, the wrong final layer, a chat template other than the one the
responses were generated with, or IDs the model never produced all pull it down, most
visibly at the first positions after the generation prompt.

Three checks hold for any data, sampled or rebuilt from text, where the absolute log-probability
depends on the temperature and on how well the model predicts text it did not write. Alignment:
the share of stored tokens likelier from the state before them than from the states one row
earlier and one row later (states stored one token off hand the win to a neighbour; with no
information each of the three wins a third). The final norm: a row the final RMS norm wrote,
divided by the norm's weight, has an RMS of exactly 1; a raw residual row has not, so the stored
rows show which kind the final slot holds. The auxiliary slots' depth order: in a residual stream
each layer adds to the state before it, so a deeper layer's state lies closer to the last layer's,
and the slots' cosines with the final state rise in the order of their layer numbers (reversed
or misplaced slots break it).

Only two tensors are read from the checkpoint, the LM head (or the tied embedding) and the
final norm, located through the safetensors index: no model is materialised.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from eagle3_datagen.chat.gates import GATES, UNUSABLE
from eagle3_datagen.formats.checkpoint import head_and_norm_names, read_tensor, rms_norm, tensor_files, text_config
from eagle3_datagen.formats.files import read_json, write_json
from eagle3_datagen.formats.hidden_shard import HiddenShard
from eagle3_datagen.formats.released import PROBE_MEASURING, RELEASED, probe_measured_with

log = logging.getLogger(__name__)

LIKELY_CAUSES = (
    "a loss mask misaligned with input_ids, the wrong final layer (check hidden_states.final and the "
    "layer indices in index.json), a chat template or chat_template_kwargs other than the ones the "
    "responses were generated with, or token IDs rebuilt from text that the model never produced"
)


MISALIGNED_CAUSES = (
    "final states stored one token off their input_ids (a capture that drops or adds a row), or a loss "
    "mask shifted against them"
)

# Rows at a sample's start hold the attention sink's massive activations, a few dimensions that dominate
# any cosine there: the auxiliary slots' depth order is read from the rows past them.
SINK_ROWS = 4

# A normed row divided by the norm's weight has an RMS of 1 to within its storage's rounding (bf16: 2^-9
# relative per value; fp8 e4m3's 2^-4 moves the mean square by under 0.1%); raw residual rows sit far off.
NORMED_RMS_TOLERANCE = 0.02


class ProbeFailure(RuntimeError):
    """A shard whose stored states do not predict its own tokens."""


@dataclass
class ProbeSettings:
    """The probe's thresholds (`probe` in config.schema.yaml says each one's meaning and default)."""

    max_positions: int  # positions probed per shard, sampled uniformly beyond that
    min_greedy_agreement: float
    first_positions: int  # response positions where template drift shows first
    min_first_agreement: float
    min_mean_logprob: float  # warning floor for sampled or text-rebuilt data
    min_aligned_best_share: float  # hard floor for any data (alignment against the neighbouring states)
    min_aux_in_order_share: float  # hard floor for any data (the auxiliary slots' depth order)
    report_positions: int
    seed: int
    max_agreement_drop: float  # lossy storage: top-1 agreement lost against the bf16 reference rows

    @classmethod
    def from_config(cls, section: dict) -> ProbeSettings:
        """From the validated config's `probe` section, where validation filled every default."""
        return cls(**{name: section[name] for name in cls.__dataclass_fields__})


class LMHead:
    """The target model's LM head and final RMS norm, read without loading the model."""

    def __init__(self, model_dir: str | Path, device: str = "cpu"):
        files = tensor_files(model_dir)
        head, norm = head_and_norm_names(model_dir, files)
        self.loaded = [head, norm]
        self.weight = read_tensor(files[head], head).to(device)
        self.norm_weight = read_tensor(files[norm], norm).to(device=device, dtype=torch.float32)
        self.eps = float(text_config(model_dir).get("rms_norm_eps", 1e-6))

    def norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden, self.norm_weight, self.eps)

    def normed_rms(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each row's RMS after dividing out the norm's weight: 1 for a row the final norm wrote."""
        weight = self.norm_weight.to(hidden.device)
        kept = weight.abs() > 1e-3 * weight.abs().max()  # a zero weight leaves nothing to divide
        return (hidden.float()[:, kept] / weight[kept]).pow(2).mean(-1).sqrt()

    def cosines_with_final(self, aux: torch.Tensor, final: torch.Tensor, normed: bool) -> torch.Tensor:
        """Each auxiliary slot's cosine ([rows, slots, H] -> [rows, slots]) with the final state before the norm:
        a normed final row divided by the norm's weight points where the raw one does (the norm rescales a
        row as a whole), so raw and normed final slots give the same cosines."""
        final = final.float()
        if normed:
            weight = self.norm_weight.to(final.device)
            kept = weight.abs() > 1e-3 * weight.abs().max()  # a zero weight erased that dimension
            final, aux = final[:, kept] / weight[kept], aux[..., kept.to(aux.device)]
        return torch.nn.functional.cosine_similarity(aux.float(), final[:, None, :], dim=-1)

    def log_probs(self, hidden: torch.Tensor, normed: bool) -> torch.Tensor:
        hidden = hidden.to(self.weight.device).float() if normed else self.norm(hidden.to(self.weight.device))
        logits = hidden.to(self.weight.dtype) @ self.weight.T
        return torch.log_softmax(logits.float(), dim=-1)


@dataclass
class _Positions:
    """Probed positions of one shard, as parallel arrays."""

    sample: np.ndarray  # index of the sample in shard order
    target: np.ndarray  # row of the predicted token within the sample
    response_position: np.ndarray  # position of that token within its assistant turn
    last_turn: np.ndarray  # whether the turn is the sample's last (the one generated with its prompt)


def _candidate_positions(masks: list[np.ndarray]) -> _Positions:
    samples, targets, offsets, last = [], [], [], []
    for k, mask in enumerate(masks):
        rows = np.flatnonzero(mask)
        rows = rows[rows >= 1]  # a token at row 0 has no state before it
        if not len(rows):
            continue
        run_start = np.ones(len(rows), dtype=bool)
        run_start[1:] = rows[1:] != rows[:-1] + 1
        starts = rows[run_start]
        run = np.cumsum(run_start) - 1
        samples.append(np.full(len(rows), k))
        targets.append(rows)
        offsets.append(rows - starts[run])
        last.append(run == run[-1])
    if not samples:
        empty = np.zeros(0, dtype=np.int64)
        return _Positions(empty, empty, empty, empty.astype(bool))
    return _Positions(*(np.concatenate(a) for a in (samples, targets, offsets, last)))


def _subsample(positions: _Positions, budget: int, seed: int) -> _Positions:
    if len(positions.sample) <= budget:
        return positions
    keep = np.sort(np.random.default_rng(seed).choice(len(positions.sample), budget, replace=False))
    return _Positions(*(a[keep] for a in positions.__dict__.values()))


def _probed_states(
    shard: HiddenShard, ids: list[str], positions: _Positions, head: LMHead, normed: bool
) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """The stored final states at offsets -1 (the one each probed token is predicted from), -2 and 0 from
    each probed token, reading only the samples probed. A neighbour outside its sample repeats the -1 row
    (`_neighboured` leaves those positions out of the alignment). With them, each auxiliary slot's cosine
    with the final state at offset -1 ([positions, slots]), computed as each sample is read."""
    rows: dict[int, list] = {offset: [None] * len(positions.sample) for offset in (-1, -2, 0)}
    slots = len(shard.index["aux_layers"])
    cosines = torch.zeros(len(positions.sample), slots)
    for k in np.unique(positions.sample):
        at = np.flatnonzero(positions.sample == k)
        sample = shard.sample(ids[k], ("hidden_states", "aux_hidden_states"))
        hidden = sample["hidden_states"]
        for offset, column in rows.items():
            wanted = positions.target[at] + offset
            wanted = np.where((wanted >= 0) & (wanted < len(hidden)), wanted, positions.target[at] - 1)
            for i, row in zip(at, hidden[torch.as_tensor(wanted)], strict=True):
                column[i] = row
        before = torch.as_tensor(positions.target[at] - 1)
        aux = sample["aux_hidden_states"][before].reshape(len(at), slots, -1)
        cosines[torch.as_tensor(at)] = head.cosines_with_final(aux, hidden[before], normed)
    return {offset: torch.stack(column) if column else torch.zeros(0) for offset, column in rows.items()}, cosines


def _neighboured(positions: _Positions, lengths: np.ndarray) -> np.ndarray:
    """Probed positions with a state on either side of the one they are predicted from in their sample."""
    return (positions.target >= 2) & (positions.target < lengths[positions.sample])


def _stats(agree: np.ndarray, logprob: np.ndarray, top5: np.ndarray) -> dict:
    if not len(agree):
        return {"positions": 0}
    return {
        "positions": int(len(agree)),
        "top1_agreement": float(agree.mean()),
        "mean_logprob": float(logprob.mean()),
        "outside_top5": float(1.0 - top5.mean()),
    }


def _predictions(
    head: LMHead, states: torch.Tensor, targets: torch.Tensor, normed: bool, chunk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each state, in chunks of `chunk` rows: the LM head's top-1 token, the log-probability of
    its target, and whether the target is in the top 5."""
    top1, logprob, top5 = [torch.zeros(0, dtype=torch.long)], [torch.zeros(0)], [torch.zeros(0, dtype=torch.bool)]
    for start in range(0, len(targets), chunk):
        log_probs = head.log_probs(states[start : start + chunk], normed).cpu()
        target = targets[start : start + chunk]
        top1.append(log_probs.argmax(-1))
        logprob.append(log_probs.gather(1, target[:, None])[:, 0])
        top5.append((log_probs.topk(5, dim=-1).indices == target[:, None]).any(-1))
    return torch.cat(top1), torch.cat(logprob), torch.cat(top5)


def _layer_error(stored: torch.Tensor, reference: torch.Tensor) -> dict:
    stored, reference = stored.float(), reference.float()
    return {
        "relative_error": float((stored - reference).norm() / reference.norm().clamp_min(1e-30)),
        "cosine": float(torch.nn.functional.cosine_similarity(stored, reference, dim=-1).mean()),
    }


def storage_cost(shard: HiddenShard, head: LMHead, chunk: int = 1024) -> dict | None:
    """Stored (decoded) states against the bf16 reference rows a lossy shard keeps: the LM head's
    agreement and mean log-prob on both, and each layer's relative error and cosine similarity.
    None for a lossless shard (it has no reference rows: its states are the reference)."""
    parts = list(shard.references())
    if not parts:
        return None
    targets = torch.cat([p["targets"] for p in parts])
    joined = {
        kind: {name: torch.cat([p[kind][name] for p in parts]) for name in parts[0][kind]}
        for kind in ("reference", "stored")
    }
    normed = shard.index["final"] == "normed"
    result = {"positions": int(len(targets))}
    top1 = {}
    for kind, states in joined.items():
        top1[kind], logprob, _ = _predictions(head, states["hidden_states"], targets, normed, chunk)
        result[kind] = {
            "top1_agreement": float((top1[kind] == targets).float().mean()) if len(targets) else None,
            "mean_logprob": float(logprob.mean()) if len(targets) else None,
        }
    result["agreement_drop"] = (
        result["reference"]["top1_agreement"] - result["stored"]["top1_agreement"] if len(targets) else 0.0
    )
    result["top1_same_as_reference"] = (
        float((top1["stored"] == top1["reference"]).float().mean()) if len(targets) else None
    )
    hidden = shard.index["hidden_size"]
    layers = [
        {
            "layer": layer,
            **_layer_error(
                *(joined[k]["aux_hidden_states"][:, i * hidden : (i + 1) * hidden] for k in ("stored", "reference"))
            ),
        }
        for i, layer in enumerate(shard.index["aux_layers"])
    ]
    layers.append(
        {"layer": "final", **_layer_error(joined["stored"]["hidden_states"], joined["reference"]["hidden_states"])}
    )
    result["layers"] = layers
    return result


def probe_shard(shard_dir: str | Path, head: LMHead, settings: ProbeSettings, chunk: int = 1024) -> dict:
    """Probe one hidden-state shard; returns the numbers (no verdict)."""
    shard = HiddenShard(shard_dir)
    # Token IDs and masks of every sample are small; final states are read only where probed.
    samples = list(shard.iter_samples(("input_ids", "loss_mask")))
    masks = [s["loss_mask"].numpy().astype(bool) for s in samples]
    candidates = _candidate_positions(masks)
    positions = _subsample(candidates, settings.max_positions, settings.seed)
    normed = shard.index["final"] == "normed"
    states, cosines = _probed_states(shard, [s["id"] for s in samples], positions, head, normed)
    tokens = torch.tensor(
        [int(samples[k]["input_ids"][j]) for k, j in zip(positions.sample, positions.target, strict=True)],
        dtype=torch.long,
    )
    top1, logprob, top5 = _predictions(head, states[-1], tokens, normed, chunk)
    agree, logprob, top5 = (top1 == tokens).numpy(), logprob.numpy(), top5.numpy()
    neighboured = _neighboured(positions, np.array([len(m) for m in masks]))
    earlier, later = (_predictions(head, states[o], tokens, normed, chunk)[1].numpy() for o in (-2, 0))
    last = positions.last_turn
    first = positions.response_position < settings.first_positions
    by_position = []
    for p in range(settings.report_positions + 1):
        at = positions.response_position == p if p < settings.report_positions else positions.response_position >= p
        label = str(p) if p < settings.report_positions else f"{p}+"
        by_position.append({"position": label, **_stats(agree[at], logprob[at], top5[at])})
    return {
        "shard": Path(shard_dir).name,
        "final": shard.index["final"],
        "storage": {key: shard.index.get(key) for key in ("dtype", "scales", "compress")},
        "storage_cost": storage_cost(shard, head, chunk),
        "tensors_loaded": head.loaded,
        "positions_total": int(len(candidates.sample)),
        "positions_probed": int(len(tokens)),
        "all": _stats(agree, logprob, top5),
        "last_turn": _stats(agree[last], logprob[last], top5[last]),
        "earlier_turns": _stats(agree[~last], logprob[~last], top5[~last]),
        "last_turn_first_positions": _stats(agree[last & first], logprob[last & first], top5[last & first]),
        "by_position": by_position,
        "alignment": _alignment(logprob[neighboured], earlier[neighboured], later[neighboured]),
        "final_norm": _final_norm(head.normed_rms(states[-1]) if len(tokens) else torch.zeros(0)),
        "aux_depth": _aux_depth(cosines[torch.as_tensor(positions.target - 1 >= SINK_ROWS)], shard.index["aux_layers"]),
    }


def _alignment(aligned: np.ndarray, earlier: np.ndarray, later: np.ndarray) -> dict:
    if not len(aligned):
        return {"positions": 0}
    means = {"logprob": float(aligned.mean()), "earlier": float(earlier.mean()), "later": float(later.mean())}
    return {
        "positions": int(len(aligned)),
        "mean_logprob": means["logprob"],
        "mean_logprob_state_one_earlier": means["earlier"],
        "mean_logprob_state_one_later": means["later"],
        "margin": means["logprob"] - max(means["earlier"], means["later"]),
        "aligned_best_share": float((aligned > np.maximum(earlier, later)).mean()),
    }


def _aux_depth(cosines: torch.Tensor, aux_layers: list[int]) -> dict:
    """The auxiliary slots' depth order, read from the stored states: in a residual stream each layer adds to
    the state before it, so a deeper layer's state lies closer to the last layer's. `in_order_share`: the
    share of rows whose slots' cosines with the final state rise in the order of index.json's layer numbers
    (reversed slots: none; slots in no order: 1 in slots! of them)."""
    if len(aux_layers) < 2 or not len(cosines):
        return {"rows": 0}
    by_depth = cosines[:, np.argsort(aux_layers, kind="stable")]
    return {
        "rows": int(len(cosines)),
        "layers": [int(layer) for layer in aux_layers],
        "median_cosine_with_final": [round(float(c), 4) for c in cosines.median(0).values],
        "in_order_share": float((by_depth.diff(dim=1) > 0).all(1).float().mean()),
    }


def _final_norm(rms: torch.Tensor) -> dict:
    if not len(rms):
        return {"rows": 0}
    share = float(((rms - 1).abs() <= NORMED_RMS_TOLERANCE).float().mean())
    return {
        "rows": int(len(rms)),
        "median_rms_over_weight": float(rms.median()),
        "normed_share": share,
        "holds": "normed" if share > 0.5 else "raw",
    }


def recorded_measurements(released: Path, measured_with: dict) -> dict:
    """What a released shard's probe measured (its released.json keeps the probe's result), without its verdict;
    `ProbeFailure` naming the fix where they were measured otherwise (other positions, another model)."""
    record = read_json(released).get("probe")
    if record is None or record.get("measured_with") != measured_with:
        had = record.get("measured_with") if record else "nothing recorded"
        raise ProbeFailure(
            f"{released.parent}: its parts were released, and its probe measured with {had}, not {measured_with}: "
            "measuring again needs the states captured again (the preflight prices it). Set the probe's "
            f"{', '.join(PROBE_MEASURING)} back, or delete {released.parent} and rerun"
        )
    return {k: v for k, v in record.items() if k not in ("partition", "backend", "greedy_exact", "verdict", "reasons")}


def verdict(result: dict, settings: ProbeSettings, greedy_exact: bool) -> tuple[str, list[str]]:
    """`ok`, `warn` or `fail`, with the reasons.

    Any data fails when its final states sit off their tokens (`aligned_best_share` below
    `min_aligned_best_share`), hold the other kind of final state than index.json says, or its auxiliary
    slots lie out of their layers' depth order (`in_order_share` below `min_aux_in_order_share`). Greedy data
    with exact output IDs must also reproduce its last turns (the earlier turns of a multi-turn sample
    sit in a context the template may render differently from the one they were generated in; they are
    reported, not judged); other data warns on a low log-probability. Lossy storage fails any data that
    loses more agreement than allowed against its reference rows.
    """
    reasons = _storage_reasons(result, settings) + _floor_reasons(result, settings)
    failed = bool(reasons)
    last, first = result["last_turn"], result["last_turn_first_positions"]
    if greedy_exact and last["positions"]:
        if last["top1_agreement"] < settings.min_greedy_agreement:
            reasons.append(
                f"top-1 agreement on the last turns is {last['top1_agreement']:.4f}, below "
                f"probe.min_greedy_agreement={settings.min_greedy_agreement}"
            )
        if first["positions"] and first["top1_agreement"] < settings.min_first_agreement:
            reasons.append(
                f"top-1 agreement on the first {settings.first_positions} response positions is "
                f"{first['top1_agreement']:.4f}, below probe.min_first_agreement={settings.min_first_agreement}"
            )
        return ("fail" if reasons else "ok"), reasons
    scope = result["all"]
    if scope["positions"] and scope["mean_logprob"] < settings.min_mean_logprob:
        reasons.append(
            f"mean log-probability of the stored tokens is {scope['mean_logprob']:.3f}, below "
            f"probe.min_mean_logprob={settings.min_mean_logprob}"
        )
    return ("fail" if failed else "warn" if reasons else "ok"), reasons


def _floor_reasons(result: dict, settings: ProbeSettings) -> list[str]:
    """The checks that hold for any data: the alignment against the neighbouring states, the auxiliary slots'
    depth order and the final slot's norm."""
    reasons = []
    alignment, norm = result["alignment"], result["final_norm"]
    if alignment["positions"] and alignment["aligned_best_share"] < settings.min_aligned_best_share:
        reasons.append(
            f"{alignment['aligned_best_share']:.1%} of the stored tokens are likelier from the final state before "
            f"them than from the states one row earlier and later, below probe.min_aligned_best_share="
            f"{settings.min_aligned_best_share}; their mean log-probability is "
            f"{alignment['mean_logprob']:.3f} from the states before them, "
            f"{alignment['mean_logprob_state_one_earlier']:.3f} from the states one row earlier and "
            f"{alignment['mean_logprob_state_one_later']:.3f} one row later; likely causes: {MISALIGNED_CAUSES}"
        )
    depth = result.get("aux_depth", {"rows": 0})  # a shard released before the depth order was measured has none
    if depth["rows"] and depth["in_order_share"] < settings.min_aux_in_order_share:
        cosines = ", ".join(
            f"hidden_states[{layer}] {c:.3f}"
            for layer, c in zip(depth["layers"], depth["median_cosine_with_final"], strict=True)
        )
        reasons.append(
            f"the auxiliary slots' cosines with the final state rise in the order of their layers on "
            f"{depth['in_order_share']:.1%} of {depth['rows']} rows, below probe.min_aux_in_order_share="
            f"{settings.min_aux_in_order_share} (a deeper layer's state lies closer to the last layer's); median "
            f"cosine of the slots index.json names {cosines}: the slots hold other layers, or the same in "
            "another order, than index.json's aux_layers. Check the capture's layer ids and their order "
            "(the smoke run's layer check names the layer each slot holds), then capture again"
        )
    if norm["rows"] and norm["holds"] != result["final"]:
        reasons.append(
            f"index.json says the final slot is {result['final']}, but {norm['normed_share']:.1%} of the probed "
            f"rows are the final RMS norm's output (median RMS over the norm weight "
            f"{norm['median_rms_over_weight']:.3f}; a normed row's is 1): the slot holds {norm['holds']} states. "
            "Check what the capture stores against hidden_states.final, then capture again"
        )
    return reasons


def _storage_reasons(result: dict, settings: ProbeSettings) -> list[str]:
    cost = result.get("storage_cost")
    if not cost or cost["agreement_drop"] <= settings.max_agreement_drop:
        return []
    return [
        f"{result['storage']['dtype']} storage loses {cost['agreement_drop']:.4f} top-1 agreement against the "
        f"bf16 reference rows ({cost['reference']['top1_agreement']:.4f} -> {cost['stored']['top1_agreement']:.4f}), "
        f"above probe.max_agreement_drop={settings.max_agreement_drop}; store bfloat16, or fp8 with finer "
        "hidden_states.scales"
    ]


def nothing_to_probe(result: dict, tokens_audit: dict) -> tuple[str, list[str]]:
    """The verdict of a shard without a trained position: `empty` when its prompt shard held no prompt
    (a partition with fewer prompts than shards, or `allow_empty`); else it fails, since an empty
    shard would reach the exports as if all were well."""
    gates = tokens_audit.get("gates") or {}
    rows = gates.get("rows", tokens_audit.get("counts", {}).get("rows_in", 0))
    if not rows:
        return "empty", ["no position to probe: the shard's prompt shard holds no prompt"]
    counts = gates.get("counts", {})
    dropped = ", ".join(f"{r} {counts[r]}" for r in (*GATES, *UNUSABLE) if counts.get(r)) or "none by a gate"
    return "fail", [
        f"no position to probe: of its {rows} response rows the tokens stage dropped {gates.get('dropped_rows', 0)} "
        f"({dropped}) and the rest hold no trained token; the hidden states ({result['positions_total']} "
        "positions) would train nothing. Check the responses and tokens.gates, then rerun the tokens"
    ]


def run_probe(
    shard_dir: str | Path,
    out_path: str | Path,
    model_path: str | Path,
    settings: ProbeSettings,
    partition: str,
    backend: str,
    greedy_exact: bool,
    tokens_audit: dict,
    device: str = "cpu",
) -> dict:
    """`tokens_audit`: the shard's tokens audit.json, which says what became of its response rows. A shard
    whose parts were released is judged again from what its probe measured before (`measured_again`)."""
    measured_with = probe_measured_with(settings.__dict__, model_path)
    released = Path(shard_dir) / RELEASED
    result = {"partition": partition, "backend": backend, "greedy_exact": greedy_exact}
    if released.exists():
        result.update(recorded_measurements(released, measured_with))
        log.info("judged again from the measurements recorded in %s", released)
    else:
        head = LMHead(model_path, device)
        log.info("read %s from %s", head.loaded, model_path)
        result.update(probe_shard(shard_dir, head, settings), measured_with=measured_with)
    if result["positions_total"]:
        result["verdict"], result["reasons"] = verdict(result, settings, greedy_exact)
    else:
        result["verdict"], result["reasons"] = nothing_to_probe(result, tokens_audit)
    log.info("probe: %s", json.dumps({k: v for k, v in result.items() if k != "by_position"}))
    if result["verdict"] == "fail":
        checked = _storage_reasons(result, settings) + _floor_reasons(result, settings)
        data = [r for r in result["reasons"] if r not in checked]
        raise ProbeFailure(
            f"partition {partition}, shard {result['shard']} ({backend}): "
            + "; ".join(result["reasons"])
            + (
                ". The stored hidden states do not predict the tokens the model generated (greedy, exact output "
                f"IDs). Likely causes: {LIKELY_CAUSES}"
                if greedy_exact and data and result["positions_total"]
                else ""
            )
        )
    for reason in result["reasons"]:
        log.warning("partition %s, shard %s: %s", partition, result["shard"], reason)
    write_json(out_path, result)
    return result
