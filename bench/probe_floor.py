#!/usr/bin/env python
"""The probe's hard floor on good shards and on the defects it must catch, planted in memory.

For each hidden-state shard: `aligned_best_share` (the share of stored tokens likelier from the final
state before them than from the states one row earlier and later) and `normed_share` (rows that are
the final norm's output) as the probe computes them, on the shard as stored and with its final states
one row early, one row late, and of the other kind than index.json says; and the auxiliary slots'
depth order (`in_order_share`, the median cosine of each slot with the final state) as stored and with
the slots reversed. Prints one JSON line a shard.

Usage: python bench/probe_floor.py --model results/demo/model results/*/hidden/0000*
Run from the repository root with the project's venv on PATH.
"""

import argparse
import json

import numpy as np
import torch

from eagle3_datagen.formats.hidden_shard import HiddenShard
from eagle3_datagen.stages.probe import NORMED_RMS_TOLERANCE, SINK_ROWS, LMHead, _aux_depth


def measure(head: LMHead, samples: list, normed: bool) -> dict:
    """The probe's two floor numbers over every trained position with a state on either side."""
    rows = {-1: [], -2: [], 0: []}
    tokens = []
    for ids, mask, hidden in samples:
        at = np.flatnonzero(mask)
        at = torch.as_tensor(at[at >= 2])
        for offset, column in rows.items():
            column.append(hidden[at + offset])
        tokens.append(ids[at])
    target = torch.cat(tokens).long()

    def logprob(states: torch.Tensor) -> np.ndarray:
        return head.log_probs(states, normed).gather(1, target[:, None])[:, 0].numpy()

    aligned, earlier, later = (logprob(torch.cat(rows[o])) for o in (-1, -2, 0))
    rms = head.normed_rms(torch.cat(rows[-1]))
    return {
        "positions": len(target),
        "aligned_best_share": round(float((aligned > np.maximum(earlier, later)).mean()), 4),
        "normed_share": round(float(((rms - 1).abs() <= NORMED_RMS_TOLERANCE).float().mean()), 4),
    }


def aux_depth(head: LMHead, shard: HiddenShard) -> dict:
    """The slots' depth order as the probe reads it, at every trained position past the sink rows, as stored
    and with the slots reversed."""
    normed, layers = shard.index["final"] == "normed", shard.index["aux_layers"]
    cosines = []
    for s in shard.iter_samples(("loss_mask", "aux_hidden_states", "hidden_states")):
        rows = np.flatnonzero(s["loss_mask"].numpy()) - 1
        rows = torch.as_tensor(rows[rows >= SINK_ROWS])
        aux = s["aux_hidden_states"][rows].reshape(len(rows), len(layers), -1)
        cosines.append(head.cosines_with_final(aux, s["hidden_states"][rows], normed))
    cosines = torch.cat(cosines)
    return {"stored": _aux_depth(cosines, layers), "reversed": _aux_depth(cosines.flip(1), layers)}


def planted(head: LMHead, shard_dir: str) -> dict:
    shard = HiddenShard(shard_dir)
    final = shard.index["final"]
    good = [
        (s["input_ids"], s["loss_mask"].numpy().astype(bool), s["hidden_states"].float())
        for s in shard.iter_samples(("input_ids", "loss_mask", "hidden_states"))
    ]
    result = {"shard": shard_dir, "final": final, "good": measure(head, good, final == "normed")}
    result["one_row_early"] = measure(head, [(i, m, torch.cat([h[1:], h[-1:]])) for i, m, h in good], final == "normed")
    result["one_row_late"] = measure(head, [(i, m, torch.cat([h[:1], h[:-1]])) for i, m, h in good], final == "normed")
    if final == "raw":  # the slot holds the norm's output where index.json says raw, and raw rows read as normed
        result["normed_says_raw"] = measure(head, [(i, m, head.norm(h)) for i, m, h in good], False)
        result["raw_says_normed"] = measure(head, good, True)
    else:  # raw rows cannot be rebuilt from normed ones: the normed rows read as raw
        result["normed_says_raw"] = measure(head, good, False)
    result["aux_depth"] = aux_depth(head, shard)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the target model directory (its LM head and final norm)")
    p.add_argument("shards", nargs="+", help="hidden-state shard directories")
    args = p.parse_args()
    head = LMHead(args.model)
    for shard_dir in args.shards:
        print(json.dumps(planted(head, shard_dir)), flush=True)


if __name__ == "__main__":
    main()
