"""One pass (`hidden_states.one_pass`): the generation request saves its own states, the capture stage packs them.

The node's launched vLLM server runs with `extract_hidden_states` (`server_args`: the auxiliary layers and
layer N, prefix caching off) and every request of a responses job asks for its output's states too
(`kv_transfer_params.include_output_tokens`): vLLM's connector writes `[P+N-1, layers, H]` states of the
prompt and of every output token but the last (which never went through the model), with the token ids they
belong to, the server's own. The turn records the file's path (`produced_by.states_path`); when the shard is
answered, `stage_states` keeps the file of each conversation's last assistant turn (its prompt is the whole
conversation before it) beside the responses, `<shard>.states/`, moved, not copied, and removes the earlier
turns'. The `hidden_states` job then packs them (`StagedStates`: a `CaptureBackend` that reads instead of
computing; `stages/hidden/one_pass.py`) into the usual shard, with no model load, and removes the staged
folder: the shard is the one copy. Each token row's ids must start with the ids the states belong to (else the
job fails: the states would be of other tokens than those trained); the row is cut to them, which drops the
last generated token and whatever the template adds after it.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3_datagen.backends.base import SingleProcess
from eagle3_datagen.formats.checkpoint import text_config
from eagle3_datagen.formats.files import read_json, write_json

if TYPE_CHECKING:
    import torch

# Asked of the server on every request: the states of the output too, not only the prompt's.
KV_TRANSFER_PARAMS = {"include_output_tokens": True}
INDEX = "index.json"


class StagedStatesError(RuntimeError):
    """Staged states that do not belong to the ids they are for, or are missing."""


def extraction_layers(model_path: str | Path, aux_spec) -> list[int]:
    """The layers the server saves: the auxiliary ones, then layer N (its output before the final norm)."""
    from eagle3_datagen.formats.hidden_shard import resolve_aux_layers  # torch: not in every responses job

    layers = text_config(model_path)["num_hidden_layers"]
    return [*resolve_aux_layers(layers, aux_spec), layers]


def server_args(layer_ids: list[int], storage: str | Path) -> list[str]:
    """The launched server's flags that turn extraction on (vLLM 0.32.0's `--speculative-config` and
    `--kv-transfer-config`, JSON), each request's file written into `storage`; prefix caching off, so that
    every token's states are computed by the request that saves them."""
    from eagle3_datagen.backends.vllm.capture import extraction_settings  # imports no vLLM

    extraction = extraction_settings(layer_ids, storage)
    return [
        "--no-enable-prefix-caching",
        "--speculative-config",
        json.dumps(extraction["speculative_config"]),
        "--kv-transfer-config",
        json.dumps(extraction["kv_transfer_config"]),
    ]


def launch_args_for(settings: dict) -> list[str]:
    """The extraction flags a responses job's launched server starts with in one-pass mode (its `vllm`
    section's `one_pass`), none without it. The storage folder is absolute: every job on the node names
    the same server."""
    one_pass = (settings.get("vllm") or {}).get("one_pass")
    if not one_pass:
        return []
    layers = extraction_layers(settings["model"]["path"], one_pass["aux_layers"])
    return server_args(layers, Path(one_pass["storage"]).resolve())


def states_dir(responses_path: str | Path) -> Path:
    """Where a responses shard's staged states go: `results/<p>/responses/<shard>.states`."""
    path = Path(responses_path)
    return path.with_name(path.name.removesuffix(".jsonl.zst") + ".states")


def _wait_written(path: str | Path) -> None:
    """Return once the server's writer is done with a request's file, and remove its lock file. vLLM's lock
    file protocol: the lock exists, held exclusively, from the request's scheduling until its file is
    written (before the client gets the path), so a shared lock waits for the file."""
    lock = Path(f"{path}.lock")
    if lock.exists():
        with open(lock) as held:
            fcntl.flock(held, fcntl.LOCK_SH)
        lock.unlink(missing_ok=True)


def _saved_ids(path: Path) -> list[int]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.get_tensor("token_ids").tolist()


def stage_states(rows: list[dict], responses_path: str | Path) -> dict:
    """Keep the states of each row's last assistant turn in `states_dir(responses_path)` (written under a
    temporary name, renamed when whole), checked to end with that turn's output ids but the last; remove
    the earlier turns' files. Returns the staged index: row id -> file name."""
    final = states_dir(responses_path)
    work = final.with_name(f".{final.name}.partial")
    if final.exists():  # an earlier run's, of other answers
        shutil.rmtree(final)
    work.mkdir(parents=True, exist_ok=True)
    staged = {}
    for number, row in enumerate(rows):
        turns = [m for m in row["messages"] if m["role"] == "assistant"]
        for k, turn in enumerate(turns):
            source = (turn.get("produced_by") or {}).get("states_path")
            if source is None:
                continue
            _wait_written(source)
            if k < len(turns) - 1:
                Path(source).unlink(missing_ok=True)
                continue
            target = work / f"{number:06d}.safetensors"
            if Path(source).exists():
                ids = _saved_ids(Path(source))
                produced = turn["output_ids"][:-1]  # none for a one-token answer: the prompt's states only
                if len(ids) <= len(produced) or (produced and ids[-len(produced) :] != produced):
                    raise StagedStatesError(
                        f"{source}: the server saved states of {len(ids)} ids that do not end with the "
                        f"{len(produced)} it generated for {row['id']!r} but the last"
                    )
                os.replace(source, target)
            elif not target.exists():  # moved by an earlier try of this job
                raise StagedStatesError(
                    f"{source}: the states of {row['id']!r} are gone; rerun its responses shard "
                    f"(`snakemake --forcerun responses` on {responses_path})"
                )
            staged[row["id"]] = target.name
    write_json(work / INDEX, staged)
    os.replace(work, final)
    return staged


class StagedStates:
    """A `base.CaptureBackend` that reads the staged states of `directory` instead of computing them: called
    with a batch of token id lists (`samples` made them), returns per sample (aux [T, A*H], final [T, H])."""

    packed = True
    ranks = SingleProcess()
    final = "raw"
    model = None  # nothing runs here: no layer check

    def __init__(self, directory: str | Path, model_path: str | Path, aux_spec):
        self.directory = Path(directory)
        if not (self.directory / INDEX).is_file():
            raise StagedStatesError(
                f"{self.directory}: no staged states (hidden_states.one_pass); rerun the responses shard that "
                "stages them (`snakemake --forcerun responses`)"
            )
        from eagle3_datagen.formats.hidden_shard import resolve_aux_layers

        self.files = read_json(self.directory / INDEX)
        config = text_config(model_path)
        self.num_layers = config["num_hidden_layers"]
        self.hidden_size = config["hidden_size"]
        self.aux_layers = resolve_aux_layers(self.num_layers, aux_spec)
        self.model_name = Path(model_path).name
        self._by_ids: dict[tuple[int, ...], Path] = {}

    def samples(self, rows: list[dict]) -> list[dict]:
        """The token rows cut to the ids their states belong to (the server's): each row's ids must start
        with them."""
        from safetensors import safe_open

        samples = []
        for row in rows:
            name = self.files.get(row["id"])
            if name is None:
                raise StagedStatesError(f"{self.directory}: no states staged for {row['id']!r}")
            path = self.directory / name
            with safe_open(str(path), "pt") as f:
                ids = f.get_tensor("token_ids").tolist()
            if row["input_ids"][: len(ids)] != ids:
                raise StagedStatesError(
                    f"{row['id']!r}: its token row's ids do not start with the {len(ids)} ids the server saved "
                    f"states of (first difference at {_first_difference(row['input_ids'], ids)}): the states are of "
                    "other tokens than those trained"
                )
            samples.append({**row, "input_ids": ids, "loss_mask": row["loss_mask"][: len(ids)]})
            self._by_ids[tuple(ids)] = path
        return samples

    def __call__(self, batch: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        from safetensors.torch import load_file

        from eagle3_datagen.formats.hidden_shard import split_stacked

        results = []
        for ids in batch:
            states = load_file(self._by_ids[tuple(ids)])["hidden_states"]  # [T, A + 1, H]
            if states.shape[1:] != (len(self.aux_layers) + 1, self.hidden_size):
                raise StagedStatesError(
                    f"staged states of shape {tuple(states.shape)}, not [T, {len(self.aux_layers) + 1}, "
                    f"{self.hidden_size}] (aux layers {self.aux_layers} and layer {self.num_layers})"
                )
            results.append(split_stacked(states))
        return results


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
