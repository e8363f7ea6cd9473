"""The smoke run: an hour on the real node, from the user's own config, before the week.

`scripts/smoke.py --configfile my.yaml --profile profiles/gpu` runs, each step timed and said to pass,
fail or be skipped (with why):

1. **GPU check** (`scripts/gpu_check.py` under torchrun on the node's GPUs: SGLang against transformers,
   layer by layer, and a server's greedy ids); skipped without GPUs or without SGLang in the config.
2. **Workflow**: the real workflow through the user's profile on a smoke config made from theirs: one
   partition per backend (or those named), one shard of at most `prompts` prompts each, greedy decoding
   (so that the probe's 0.98 applies), no baseline twins; in a working directory of its own (`smoke/`:
   links to the workflow's files, its own results, logs and Snakemake records), so the week's results
   are untouched.
3. **Probe**: each smoke partition's probe verdict, and on greedy data with exact ids a top-1 agreement
   of at least 0.98 on the last turns.
4. **Auxiliary layers**: a few samples' stored layers, in the hidden-state shard and both exports,
   against an independent transformers capture at the published layer convention
   (`diagnostics/layer_check.py`): this catches reversed or shifted auxiliary layers and a missing
   final norm, which the probe does not.
5. **Draft**: a small draft trained with SpecForge 0.2.0 on the smoke export. On a GPU node it is
   served with SGLang 0.5.23's EAGLE3 and its acceptance length read from SGLang's own figures
   (`scripts/serve_draft.py`); on a CPU, where SGLang's EAGLE3 cannot run (its CPU path needs kernels
   PyPI does not ship), the evaluate stage's transformers measurement is reported instead, said so.
6. **Measurements**: the generation and capture tokens/s of the smoke shards and the model loads'
   seconds, written where the plan reads them (`logs/smoke/rates.json`, `formats/measured_rates.py`;
   `logs/smoke/loads.jsonl`, `formats/service_loads.py`): `scripts/plan.py` then plans the week with
   the node's own figures.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

from eagle3_datagen.backends.plugins import CAPTURE, GENERATION
from eagle3_datagen.backends.service import gpus
from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.formats import sources
from eagle3_datagen.formats.files import InputError, read_json, write_json
from eagle3_datagen.formats.measured_rates import write_rates
from eagle3_datagen.formats.service_loads import NAME as LOADS
from eagle3_datagen.formats.service_loads import read_loads
from eagle3_datagen.workflow.partitions import inference_backend

# What the smoke directory links to in the workflow's: what a run reads there (rules, scripts, its
# conda envs, report captions, bundled resources, profiles and the links that name them, shipped configs).
LINKED = ["Snakefile", "rules", "scripts", "envs", "report", "resources", "profiles", "config"]
PROFILE_LINKS = ["gpu", "local", "slurm"]
MARKER = ".eagle3-datagen-smoke"  # a smoke directory, which the next smoke run may empty
MIN_AGREEMENT = 0.98
SGLANG_EAGLE3_ON_CPU = (
    "SGLang's EAGLE3 cannot run on the CPU (its CPU path needs sgl-kernel's CPU build, which PyPI does not ship): "
    "the evaluate stage's measurement, greedy chain speculative decoding in transformers"
)


class SmokeError(RuntimeError):
    """A step that cannot go on; the message says why."""


@dataclass
class Step:
    name: str
    status: str  # pass, fail or skip
    seconds: float
    detail: str


def smoke_partitions(config: dict, named: list[str] | None) -> list[str]:
    """The partitions named, or the first (by name) of each backend."""
    if named:
        unknown = sorted(set(named) - set(config["partitions"]))
        if unknown:
            raise InputError("--partitions", None, f"no partition {unknown} in the config", "name the config's own")
        return sorted(named)
    first = {}
    for name in sorted(config["partitions"]):
        first.setdefault(inference_backend(config, name), name)
    return sorted(first.values())


def _absolute(value: str | None, root: Path) -> str | None:
    """A path of the config, resolved from the workflow directory (the smoke run works in another)."""
    if value is None or sources.is_hub(value) or "://" in value or os.path.isabs(value):
        return value
    return str(root / value)


def smoke_config(config: dict, partitions: list[str], prompts: int, root: Path) -> dict:
    """The user's config, narrowed to a smoke run (see the module's docstring), its paths resolved from `root`."""
    smoke = copy.deepcopy(config)
    smoke["partitions"] = {}
    for name in partitions:
        part = {
            **config["partitions"][name],
            "shards": 1,
            "source": _absolute(config["partitions"][name]["source"], root),
        }
        part["max_prompts"] = min(prompts, part.get("max_prompts") or prompts)
        smoke["partitions"][name] = part
    smoke["inference"].setdefault("sampling", {})["temperature"] = 0.0
    # the layer check reads the shards' parts after the exports, which would otherwise release them
    smoke.setdefault("hidden_states", {})["keep_shards"] = True
    if "demo" not in smoke:  # a demo builds its model inside the smoke directory
        smoke["model"]["path"] = _absolute(smoke["model"]["path"], root)
    elif smoke["demo"].get("tokenizer"):
        smoke["demo"]["tokenizer"] = _absolute(smoke["demo"]["tokenizer"], root)
    if (smoke.get("plan") or {}).get("tokenizer"):
        smoke["plan"]["tokenizer"] = _absolute(smoke["plan"]["tokenizer"], root)
    evaluate = fill_defaults(dict(smoke.get("evaluate") or {}), "evaluate")
    smoke["evaluate"] = {**evaluate, "baseline": "none", "python": _absolute(evaluate["python"], root)}
    return smoke


def prepare(work: Path, root: Path, config: dict) -> Path:
    """An empty smoke directory (a former one emptied, never another folder) with links to the workflow."""
    if work.exists():
        if not (work / MARKER).exists() and any(work.iterdir()):
            raise SmokeError(f"{work} exists and is not a smoke directory: name another with --work")
        shutil.rmtree(work)
    work.mkdir(parents=True)
    (work / MARKER).touch()
    for name in [*LINKED, *PROFILE_LINKS]:
        if (root / name).exists():
            (work / name).symlink_to((root / name).resolve())
    config_file = work / "smoke.yaml"
    config_file.write_text(json.dumps(config, indent=1))  # YAML reads JSON
    return config_file


class Smoke:
    """Runs the steps, prints each as it ends and a table at the end (`out`), keeps them in smoke.json."""

    def __init__(self, root: Path, work: Path, config: dict, profile: str, samples: int, out: TextIO):
        self.root, self.work, self.config, self.profile, self.samples, self.out = (
            root,
            work,
            config,
            profile,
            samples,
            out,
        )
        self.steps: list[Step] = []
        self.partitions = sorted(config["partitions"])
        self.gpus = self._gpus()

    def _gpus(self) -> int:
        if shutil.which(gpus.NVIDIA_SMI) is None:
            return 0
        try:
            return len(gpus.query_gpus())
        except gpus.ServiceError:
            return 0

    def step(self, name: str, run: Callable[[], tuple[str, str]]) -> bool:
        """Run one step: `run` returns (status, detail) or raises (a failure, its message the detail)."""
        started = time.monotonic()
        try:
            status, detail = run()
        except Exception as e:  # noqa: BLE001 - every failure is the step's result, named
            status, detail = "fail", f"{type(e).__name__}: {e}"
        self.steps.append(Step(name, status, round(time.monotonic() - started, 1), detail))
        print(f"[smoke] {name}: {status.upper()} ({self.steps[-1].seconds:.1f} s) {detail}", file=self.out, flush=True)
        write_json(self.work / "smoke.json", {"steps": [asdict(s) for s in self.steps]})
        return status != "fail"

    def results(self, *parts: str) -> Path:
        return self.work / "results" / Path(*parts)

    # the steps

    def gpu_check(self) -> tuple[str, str]:
        uses_sglang = CAPTURE[self.config["hidden_states"]["backend"]].imports == "sglang" or any(
            GENERATION[inference_backend(self.config, p)].imports == "sglang" for p in self.partitions
        )
        if not self.gpus:
            return "skip", "no GPU on this machine (nvidia-smi lists none): it compares SGLang with hf on GPUs"
        if not uses_sglang:
            return "skip", "the config runs no SGLang (the check compares SGLang with hf)"
        gpus.wait_for_free_memory(**self._handover(), what="GPU check")
        count = self.config["resources"]["gpus_per_node"]
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(count)]
        command += [str(self.root / "scripts/gpu_check.py"), "--launch", "--out", str(self.work / "gpu_check.json")]
        with open(self.work / "gpu_check.log", "w") as log:
            done = subprocess.run(command, cwd=self.work, stdout=log, stderr=subprocess.STDOUT, env=self._env())
        status = "pass" if done.returncode == 0 else "fail"
        return (
            status,
            f"SGLang against hf on {count} GPUs, layer by layer and greedy ids ({self.work / 'gpu_check.log'})",
        )

    def workflow(self) -> tuple[str, str]:
        from eagle3_datagen.cli import failure_reasons

        command = [
            str(Path(sys.executable).parent / "snakemake"),
            "--profile",
            self.profile,
            "--configfile",
            "smoke.yaml",
        ]
        if self.gpus:  # the evaluate stage measures on the CPU, which a node-sized target cannot: step 5 does
            command += ["--omit-from", "evaluate", "evaluate_all"]
        with open(self.work / "workflow.log", "w") as log:
            done = subprocess.run(command, cwd=self.work, stdout=log, stderr=subprocess.STDOUT, env=self._env())
        if done.returncode != 0:
            reasons = failure_reasons((self.work / "workflow.log").read_text(errors="replace"))
            return "fail", "; ".join(reasons) + f" (the whole log: {self.work / 'workflow.log'})"
        prompts = sum(read_json(self.results(p, "prompts/stats.json")).get("prompts", 0) for p in self.partitions)
        return (
            "pass",
            f"{len(self.partitions)} partition(s) {', '.join(self.partitions)}: {prompts} prompts, one shard each",
        )

    def probe(self) -> tuple[str, str]:
        found, failed = [], False
        for p in self.partitions:
            probe = read_json(self.results(p, "probe/00000.json"))
            agreement = probe["last_turn"]["top1_agreement"]
            if probe["greedy_exact"]:
                ok = probe["verdict"] != "fail" and agreement >= MIN_AGREEMENT
                found.append(f"{p} top-1 {agreement:.4f} (greedy, exact ids: at least {MIN_AGREEMENT})")
            else:
                ok = probe["verdict"] != "fail"
                found.append(f"{p} top-1 {agreement:.4f}, verdict {probe['verdict']} (not greedy with exact ids)")
            failed |= not ok
        return ("fail" if failed else "pass"), "; ".join(found)

    def layers(self) -> tuple[str, str]:
        from eagle3_datagen.diagnostics.layer_check import check_layers, format_rows

        p = self.partitions[0]
        exports = {f: self.results(p, "export", f) for f in self.config["export"]["formats"]}
        if self.gpus:
            gpus.wait_for_free_memory(**self._handover(), what="independent capture")
        model = self.work / self.config["model"]["path"]  # absolute, or the demo's under the smoke directory
        ok, rows = check_layers(
            model,
            self.results(p, "hidden/00000"),
            exports,
            self.config["hidden_states"]["aux_layers"],
            self.samples,
            self.config["model"]["trust_remote_code"],
        )
        write_json(self.work / "layer_check.json", {"ok": ok, "slots": rows})
        print(format_rows(rows), file=self.out, flush=True)
        wrong = [f"{r['where']} {r['slot']} holds {r['best_match']}, not {r['expected']}" for r in rows if not r["ok"]]
        layers = sorted({r["expected"] for r in rows if r["slot"] != "final"})
        detail = (
            "; ".join(wrong)
            if wrong
            else f"{p}: {', '.join(layers)} and the final, in the shard and {', '.join(exports)}"
        )
        return ("pass" if ok else "fail"), detail

    def draft(self) -> tuple[str, str]:
        settings = self.config["evaluate"]
        if not self.gpus:
            found, low = [], False
            for p in self.partitions:
                figures = read_json(self.results(p, "evaluate/acceptance.json"))
                found.append(
                    f"{p} acceptance length {figures['acceptance_length']:.3f} ({figures['prompts']} held-out)"
                )
                low |= figures["acceptance_length"] < settings["min_acceptance_length"]
            return ("fail" if low else "pass"), "; ".join(found) + f". {SGLANG_EAGLE3_ON_CPU}"
        p = self.partitions[0]
        gpus.wait_for_free_memory(**self._handover(), what="EAGLE3 server")
        sglang = self.config["inference"].get("sglang") or {}
        launch = sglang.get("launch") or fill_defaults({}, "inference.sglang.launch")
        if "launch" not in sglang:
            launch["run_args"] = ["--tp", str(self.config["resources"]["gpus_per_node"])]
            launch["args"] = ["--trust-remote-code"] if self.config["model"]["trust_remote_code"] else []
        out = self.work / "draft.json"
        command = [settings["python"], str(self.root / "scripts/serve_draft.py")]
        command += ["--export", str(self.results(p, "export/specforge"))]
        command += ["--tokens", str(self.results(p, "tokens/00000.jsonl.zst"))]
        command += ["--holdout", str(self.results(p, "evaluate/holdout.json"))]
        command += [
            "--settings",
            json.dumps(settings),
            "--launch",
            json.dumps(launch),
            "--url",
            "http://127.0.0.1:30000",
        ]
        command += ["--sglang-python", sys.executable, "--server-log", str(self.work / "eagle3-server.log")]
        command += ["--out", str(out)]
        with open(self.work / "draft.log", "w") as log:
            done = subprocess.run(command, cwd=self.work, stdout=log, stderr=subprocess.STDOUT, env=self._env())
        if done.returncode != 0:
            return "fail", f"training or serving the draft failed ({self.work / 'draft.log'})"
        figures = read_json(out)
        length = figures["acceptance_length"]
        status = "pass" if length >= settings["min_acceptance_length"] else "fail"
        held_out = figures["prompts"]
        return (
            status,
            f"{p}: acceptance length {length:.3f} over {held_out} held-out prompts ({figures['measured_by']})",
        )

    def measurements(self) -> tuple[str, str]:
        generated = generating = captured = capturing = 0.0
        for p in self.partitions:
            if GENERATION[inference_backend(self.config, p)].on_node:
                throughput = read_json(self.results(p, "responses/00000.stats.json"))["throughput"]
                generated, generating = generated + throughput["completion_tokens"], generating + throughput["seconds"]
            index = read_json(self.results(p, "hidden/00000/index.json"))["throughput"]
            captured, capturing = captured + index["tokens"], capturing + index["seconds"]
        model = str(Path(self.work / self.config["model"]["path"]).resolve())
        week_model = str((self.root / self.config["model"]["path"]).resolve())  # the week's run names it so
        rates = {"model": week_model, "time": datetime.now(UTC).isoformat(timespec="seconds"), "config": "smoke"}
        if generating:
            rates["generate_tokens_per_s"] = round(generated / generating, 1)
        if capturing:
            rates["prefill_tokens_per_s"] = round(captured / capturing, 1)
        logs = self.root / "logs"
        written = write_rates(logs, rates)
        loads = [{**r, "model": week_model} for r in read_loads(self.work / "logs") if r["model"] == model]
        loads_file = logs / "smoke" / LOADS
        loads_file.write_text("".join(json.dumps(r) + "\n" for r in loads))
        seconds = ", ".join(f"{r['service']} {r['seconds']} s" for r in loads) or "none (no node service loaded)"
        said = [f"{k.removesuffix('_tokens_per_s')} {v} tokens/s" for k, v in rates.items() if k.endswith("_per_s")]
        return (
            "pass",
            f"{', '.join(said)}; loads: {seconds}; in {written} and {loads_file} (scripts/plan.py reads them)",
        )

    def _handover(self) -> dict:
        handover = self.config["resources"]["handover"]
        return {"timeout": handover["timeout"], "max_used_mib": handover["max_used_mib"]}

    def _env(self) -> dict:
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # every job imports torch and transformers afresh
        return env

    def run(self) -> bool:
        self.step("GPU check", self.gpu_check)
        if self.step("workflow", self.workflow):
            for name, run in (("probe", self.probe), ("auxiliary layers", self.layers), ("draft", self.draft)):
                self.step(name, run)
            self.step("measurements", self.measurements)
        else:
            for name in ("probe", "auxiliary layers", "draft", "measurements"):
                self.steps.append(Step(name, "skip", 0.0, "the workflow did not finish"))
        width = max(len(s.name) for s in self.steps)
        print("\nsmoke run:", file=self.out)
        for s in self.steps:
            print(f"  {s.name:<{width}}  {s.status.upper():<4}  {s.seconds:>7.1f} s  {s.detail}", file=self.out)
        total = sum(s.seconds for s in self.steps)
        failed = [s.name for s in self.steps if s.status == "fail"]
        verdict = f"FAILED: {', '.join(failed)}" if failed else "passed"
        print(f"  {'total':<{width}}  {'':<4}  {total:>7.1f} s  {verdict}", file=self.out, flush=True)
        return not failed
