"""The smoke run: the user's own config on the real node, before the week, its time said before it starts.

`scripts/smoke.py --configfile my.yaml --profile profiles/gpu` first prints its steps, the model loads of
each and their estimated minutes (`planned_steps`: the plan's rates and load seconds, `reporting/plan.py`),
then runs them, each timed and said to pass, fail or be skipped (with why). Every step that uses the GPUs
runs in a process of its own, started once the GPUs' memory is free (`resources.handover`, the wait the
node's services use); the smoke process itself never loads the model:

1. **GPU check** (`scripts/gpu_check.py` under torchrun, one rank per GPU of `resources.gpus_per_node`, on
   the config's model: SGLang's capture at that tensor parallelism against transformers, layer by layer);
   both engines hold the model at once, so a model one copy of which is over 40% of the GPUs' memory
   (Kimi-K2.5) is compared on its first 7 layers (`model_slice.py`), said in the plan with the bytes each
   engine loads; skipped without GPUs or without SGLang in the config.
2. **Workflow**: the real workflow through the user's profile on a smoke config made from theirs: one
   partition per backend (or those named), one shard of at most `prompts` prompts each, greedy decoding
   (every backend's sampling, so that the probe's 0.98 applies), no baseline twins (unless `baseline`: the
   config's `evaluate.baseline` kept, its twins and the data curve's drafts on them), the capture runner
   recording every layer of `samples` samples a shard (`hidden_states.layer_check_samples`); in a
   working directory of its own (`smoke/`: links to the workflow's files, its own results, logs and
   Snakemake records), so the week's results are untouched.
3. **Probe**: each smoke partition's probe verdict, and on greedy data with exact ids a top-1 agreement
   of at least 0.98 on the last turns.
4. **Auxiliary layers**: those samples' stored slots, in the hidden-state shard and both exports, against
   the layers the capture runner's hooks recorded, at the published layer convention
   (`diagnostics/layer_check.py`): this catches reversed or shifted auxiliary layers and a missing final
   norm, which the probe does not. It reads files: no model load.
5. **Draft**: a small draft trained with SpecForge 0.2.0 on the smoke export. On a GPU node it is
   served with SGLang 0.5.23's EAGLE3 and its acceptance length read from SGLang's own figures
   (`scripts/serve_draft.py`); on a CPU, where SGLang's EAGLE3 cannot run (its CPU path needs kernels
   PyPI does not ship), the evaluate stage's transformers measurement is reported instead, said so.
6. **Measurements**: the generation and capture tokens/s of the smoke shards and the model loads'
   seconds, written where the plan reads them (`logs/smoke/rates.json`, `formats/measured_rates.py`;
   `logs/smoke/loads.jsonl`, `formats/service_loads.py`): `scripts/plan.py` then plans the week with
   the node's own figures, and the next smoke run estimates its own time with them.
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
from eagle3_datagen.diagnostics.model_slice import CheckSize, check_size
from eagle3_datagen.formats import sources
from eagle3_datagen.formats.files import InputError, read_json, write_json
from eagle3_datagen.formats.measured_rates import write_rates
from eagle3_datagen.formats.service_loads import NAME as LOADS
from eagle3_datagen.formats.service_loads import read_loads
from eagle3_datagen.reporting.plan import measured_loads, plan_rates
from eagle3_datagen.workflow.partitions import inference_backend, served_by_launched_server
from eagle3_datagen.workflow.settings import sampling_for

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


@dataclass
class PlannedStep:
    """A step as announced before the run: what runs it, the model loads it makes, its estimated minutes
    (None where a rate it needs is neither measured nor configured) and what they rest on."""

    name: str
    process: str
    loads: list[str]
    minutes: float | None
    basis: str


def _load_seconds(week: dict, logs: Path, service: str) -> tuple[float, str]:
    """Seconds one load of the week's model by `service` takes: measured (a smoke run's, the week's logs)
    or `plan.load_seconds`."""
    seen = measured_loads(logs, service, str(Path(week["model"]["path"]).resolve()))
    if seen:
        return sum(seen) / len(seen), f"{service} load measured, mean of {len(seen)}"
    return week["plan"]["load_seconds"][service], f"{service} load from plan.load_seconds"


def gpu_check_size(config: dict, root: Path, gpu_bytes: int) -> CheckSize | None:
    """What the GPU check loads of the config's model (paths from `root`) on GPUs of `gpu_bytes` in all;
    None where the model is not built yet (a demo's)."""
    model = root / config["model"]["path"]
    return check_size(model, gpu_bytes) if (model / "config.json").exists() else None


def planned_steps(smoke: dict, week: dict, root: Path, gpus: int, gpu_bytes: int) -> list[PlannedStep]:
    """The smoke run's steps with their model loads and estimated minutes, from the plan's rates and load
    seconds for the week's model (`week`: the user's config; run from `root`, on `gpus` GPUs of `gpu_bytes`
    in all): generation at most `max_new_tokens` a prompt, capture at most `tokens.max_length` a prompt,
    upper bounds; the GPU check's loads in proportion to the bytes it loads."""
    logs = root / "logs"
    week = {**week, "model": {**week["model"], "path": str(root / week["model"]["path"])}}  # as measurements names it
    rates = {k: v["tokens_per_s"] for k, v in plan_rates(week, logs).items()}
    runner_s, runner_basis = _load_seconds(week, logs, "capture_runner")
    server_s, server_basis = _load_seconds(week, logs, "generation_server")
    partitions = sorted(smoke["partitions"])
    steps = []
    tp = smoke["resources"]["gpus_per_node"]
    if gpus and _uses_sglang(smoke, partitions):
        try:
            size = gpu_check_size(smoke, root, gpu_bytes)
            what = size.describe() if size else "the model, not built yet"
        except ValueError as e:  # not even its slice fits: the step fails, the others go on
            size, what = None, f"nothing: {e}"
        share = size.bytes / size.checkpoint_bytes if size else 1.0
        steps.append(
            PlannedStep(
                "GPU check",
                f"torchrun, {tp} ranks: scripts/gpu_check.py on {what}",
                [f"SGLang model runner (TP {tp})", "transformers"],
                2 * runner_s * share / 60,
                f"2 x {share:.3g} x {runner_basis}",
            )
        )
    loads, seconds, basis, unknown = [], 0.0, [], []
    if any(served_by_launched_server(smoke, p) for p in partitions):
        loads.append("generation server")
        seconds += server_s
        basis.append(server_basis)
    for p in partitions:
        backend = inference_backend(smoke, p)
        if GENERATION[backend].on_node:
            if not served_by_launched_server(smoke, p):
                loads.append(f"{backend} responses job ({p})")
                seconds += runner_s
            tokens = smoke["partitions"][p]["max_prompts"] * sampling_for(smoke, backend)["max_new_tokens"]
            if rates["generate_tokens_per_s"]:
                seconds += tokens / rates["generate_tokens_per_s"]
            else:
                unknown.append("generate_tokens_per_s")
        if rates["prefill_tokens_per_s"]:
            seconds += (
                smoke["partitions"][p]["max_prompts"] * smoke["tokens"]["max_length"] / rates["prefill_tokens_per_s"]
            )
        else:
            unknown.append("prefill_tokens_per_s")
    loads.append("capture runner")
    seconds += runner_s
    basis.append(runner_basis)
    if unknown:
        basis.append(f"no {' or '.join(sorted(set(unknown)))} (plan.throughput, or a smoke run's measurement)")
    steps.append(
        PlannedStep(
            "workflow",
            "snakemake (its jobs: the node's services)",
            loads,
            None if unknown else seconds / 60,
            "; ".join(basis),
        )
    )
    steps.append(PlannedStep("probe", "this process (reads the probes)", [], 0.0, "reads files"))
    steps.append(PlannedStep("auxiliary layers", "this process (reads the runner's records)", [], 0.0, "reads files"))
    if gpus:
        steps.append(
            PlannedStep(
                "draft",
                "scripts/serve_draft.py: SpecForge training, then SGLang's EAGLE3 server",
                ["EAGLE3 server (the target and the draft)"],
                server_s / 60,
                f"{server_basis}, and the training's {smoke['evaluate']['steps']} steps",
            )
        )
    else:
        steps.append(PlannedStep("draft", "this process (the evaluate stage's figures)", [], 0.0, "reads files"))
    steps.append(PlannedStep("measurements", "this process", [], 0.0, "reads files"))
    return steps


def format_planned(steps: list[PlannedStep]) -> str:
    """The announcement: each step, what runs it, its model loads, its minutes; the totals."""
    width = max(len(s.name) for s in steps)
    lines = ["smoke run, before it starts (each GPU step in a process of its own):"]
    for s in steps:
        minutes = "?" if s.minutes is None else f"{s.minutes:.1f}"
        loads = ", ".join(s.loads) or "none"
        lines.append(f"  {s.name:<{width}}  ~{minutes:>6} min  loads: {loads}; {s.process} ({s.basis})")
    loads = sum(len(s.loads) for s in steps)
    known = [s.minutes for s in steps if s.minutes is not None]
    unknown = " and the steps marked ?" if len(known) < len(steps) else ""
    lines.append(f"  {'total':<{width}}  ~{sum(known):>6.1f} min{unknown}; {loads} model loads")
    return "\n".join(lines)


def _uses_sglang(config: dict, partitions: list[str]) -> bool:
    return CAPTURE[config["hidden_states"]["backend"]].imports == "sglang" or any(
        GENERATION[inference_backend(config, p)].imports == "sglang" for p in partitions
    )


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


def smoke_config(
    config: dict, partitions: list[str], prompts: int, samples: int, root: Path, baseline: bool = False
) -> dict:
    """The user's config, narrowed to a smoke run (see the module's docstring), its paths resolved from `root`;
    the capture runner records every layer of `samples` samples a shard; the config's `evaluate.baseline`
    kept with `baseline`, else none (its twins double the evaluate stage's trainings)."""
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
    # greedy, so that the probe's 0.98 applies: a backend's own sampling would override inference.sampling's
    for section in [smoke["inference"].setdefault("sampling", {}), *_backend_samplings(smoke["inference"])]:
        section["temperature"] = 0.0
    hidden = smoke.setdefault("hidden_states", {})
    # the layer check reads the shards' parts after the exports, which would otherwise release them
    hidden["keep_shards"] = True
    hidden["layer_check_samples"] = samples
    if "demo" not in smoke:  # a demo builds its model inside the smoke directory
        smoke["model"]["path"] = _absolute(smoke["model"]["path"], root)
    elif smoke["demo"].get("tokenizer"):
        smoke["demo"]["tokenizer"] = _absolute(smoke["demo"]["tokenizer"], root)
    if (smoke.get("plan") or {}).get("tokenizer"):
        smoke["plan"]["tokenizer"] = _absolute(smoke["plan"]["tokenizer"], root)
    evaluate = fill_defaults(dict(smoke.get("evaluate") or {}), "evaluate")
    smoke["evaluate"] = {
        **evaluate,
        "baseline": evaluate["baseline"] if baseline else "none",
        "python": _absolute(evaluate["python"], root),
    }
    return smoke


def _backend_samplings(inference: dict) -> list[dict]:
    """Each generation backend's own `sampling` section in `inference`."""
    return [inference[name]["sampling"] for name in GENERATION if (inference.get(name) or {}).get("sampling")]


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

    def __init__(self, root: Path, work: Path, config: dict, profile: str, out: TextIO):
        self.root, self.work, self.config, self.profile, self.out = root, work, config, profile, out
        self.steps: list[Step] = []
        self.partitions = sorted(config["partitions"])
        found = self._gpus()
        self.gpus = len(found)
        self.gpu_bytes = sum(g.total_mib for g in found) * 2**20

    def _gpus(self) -> list[gpus.Gpu]:
        if shutil.which(gpus.NVIDIA_SMI) is None:
            return []
        try:
            return gpus.query_gpus()
        except gpus.ServiceError:
            return []

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

    def gpu_process(self, what: str, command: list[str], log_name: str) -> int:
        """Run a step's GPU work as a process of its own, once the GPUs the step before used have their
        memory back (on a node; the same wait as the node's services); its output to `log_name` in the
        smoke directory. Returns its exit status."""
        if self.gpus:
            gpus.wait_for_free_memory(**self._handover(), what=what)
        with open(self.work / log_name, "w") as log:
            return subprocess.run(
                command, cwd=self.work, stdout=log, stderr=subprocess.STDOUT, env=self._env()
            ).returncode

    def gpu_check(self) -> tuple[str, str]:
        if not self.gpus:
            return "skip", "no GPU on this machine (nvidia-smi lists none): it compares SGLang with hf on GPUs"
        if not _uses_sglang(self.config, self.partitions):
            return "skip", "the config runs no SGLang (the check compares SGLang with hf)"
        count = self.config["resources"]["gpus_per_node"]
        model = str(self.work / self.config["model"]["path"])  # absolute, or the demo's under the smoke directory
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(count)]
        command += [
            str(self.root / "scripts/gpu_check.py"),
            "--model",
            model,
            "--out",
            str(self.work / "gpu_check.json"),
        ]
        size = gpu_check_size(self.config, self.work, self.gpu_bytes)
        if size:  # the layers the plan announced
            command += ["--layers", str(size.layers)]
        if self.config["model"]["trust_remote_code"]:
            command.append("--trust-remote-code")
        done = self.gpu_process("GPU check", command, "gpu_check.log")
        what = size.describe() if size else "the whole model"
        return (
            "pass" if done == 0 else "fail",
            f"SGLang against hf on {model} ({what}) at TP {count}, layer by layer ({self.work / 'gpu_check.log'})",
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
        if self.gpu_process("workflow", command, "workflow.log") != 0:
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
        from eagle3_datagen.formats.hidden_shard import layer_tap_path

        p = self.partitions[0]
        exports = {f: self.results(p, "export", f) for f in self.config["export"]["formats"]}
        shard = self.results(p, "hidden/00000")
        ok, rows = check_layers(layer_tap_path(shard), shard, exports, self.config["hidden_states"]["aux_layers"])
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
        if self.gpu_process("EAGLE3 server", command, "draft.log") != 0:
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

    def run(self, planned: list[PlannedStep]) -> bool:
        """The steps, after printing `planned` (`planned_steps`); the table at the end sets each step's
        measured time beside its estimate."""
        print(format_planned(planned) + "\n", file=self.out, flush=True)
        self.step("GPU check", self.gpu_check)
        if self.step("workflow", self.workflow):
            for name, run in (("probe", self.probe), ("auxiliary layers", self.layers), ("draft", self.draft)):
                self.step(name, run)
            self.step("measurements", self.measurements)
        else:
            for name in ("probe", "auxiliary layers", "draft", "measurements"):
                self.steps.append(Step(name, "skip", 0.0, "the workflow did not finish"))
        estimated = {s.name: s.minutes for s in planned}
        width = max(len(s.name) for s in self.steps)
        print("\nsmoke run (measured; estimated before it started):", file=self.out)
        for s in self.steps:
            guess = estimated.get(s.name)
            guess = "?" if guess is None else f"{guess:.1f}"
            print(
                f"  {s.name:<{width}}  {s.status.upper():<4}  {s.seconds:>7.1f} s  (~{guess} min)  {s.detail}",
                file=self.out,
            )
        total = sum(s.seconds for s in self.steps)
        failed = [s.name for s in self.steps if s.status == "fail"]
        verdict = f"FAILED: {', '.join(failed)}" if failed else "passed"
        print(f"  {'total':<{width}}  {'':<4}  {total:>7.1f} s  {verdict}", file=self.out, flush=True)
        return not failed
