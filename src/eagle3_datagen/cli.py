"""Shared pieces of the stage entry points in `scripts/`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from eagle3_datagen.backends.base import MissingApiKey, ServerError, StopRun
from eagle3_datagen.formats.checksums import ChecksumError
from eagle3_datagen.formats.files import DiskFull, InputError
from eagle3_datagen.workflow.settings import RUN_SETTINGS_ENV, merged


class SnakemakeFailed(RuntimeError):
    """A Snakemake run that a script started failed; the message says why."""


# Errors whose message tells the user what to fix: bad input, a full disk, a missing file or key, a model server
# that is not there. A script adds its stage's own (a failed check, a stopped budget, a chat template
# that does not fit) where it calls `run`: importing them here would import every stage.
USER_ERRORS = (
    InputError,
    DiskFull,
    ChecksumError,
    FileNotFoundError,
    MissingApiKey,
    ServerError,
    StopRun,
    SnakemakeFailed,
)
USER_ERROR_EXIT = 2


def run(main: Callable[[], None], user_errors: tuple[type[BaseException], ...] = ()) -> None:
    """Every script's entry point: a user error ends the script with one line, `error: MESSAGE`, last on
    stderr (the rule's log, whose last line the workflow also prints on the console), and exit status 2,
    never a traceback; anything else is a bug and keeps its traceback. A message of several lines (a
    server log's tail) is written whole first, then its first line as the `error:` line."""
    try:
        main()
    except (*USER_ERRORS, *user_errors) as e:
        message = str(e).strip() or type(e).__name__
        first = message.splitlines()[0]
        if first != message:
            print(message, file=sys.stderr)
        print(f"error: {first}", file=sys.stderr, flush=True)
        sys.exit(USER_ERROR_EXIT)


CONSOLE_MARK = "note: "


def console(line: str) -> None:
    """Write `line` for the console: a rule that asks for it (`logged(..., notes=True)` in rules/common.smk)
    prints its log's `note: ` lines there when the job succeeds, as it prints the `error:` line when it fails."""
    print(f"{CONSOLE_MARK}{line}", file=sys.stderr, flush=True)


class ArgumentParser(argparse.ArgumentParser):
    """Every script's parser: its docstring kept as written in --help; a wrong argument ends the script as
    any user error does, one line `error: ...` and exit status 2 (argparse's own prints the usage first)."""

    def __init__(self, description: str):
        super().__init__(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)

    def error(self, message: str):
        self.exit(USER_ERROR_EXIT, f"error: {message} (see {self.prog} --help)\n")


def parser(description: str, stage_settings: bool = True) -> ArgumentParser:
    """A script's parser; a stage's (`stage_settings`) takes the workflow's --settings, --run-settings and
    --threads."""
    p = ArgumentParser(description)
    if not stage_settings:
        return p
    p.add_argument(
        "--settings",
        required=True,
        type=json.loads,
        help="the stage's settings as JSON (the workflow passes the validated config section)",
    )
    p.add_argument(
        "--run-settings",
        type=json.loads,
        help="settings that govern only how the job runs (concurrency, batch sizes, timeouts, budgets) as JSON, "
        f"merged into --settings (default: this stage's from ${RUN_SETTINGS_ENV}, which the workflow sets)",
    )
    p.add_argument("--threads", type=int, default=1, help="CPU threads for torch and tokenizers")
    return p


def setup(args: argparse.Namespace, stage: str | None = None, torch_threads: bool = True) -> None:
    """Log to stderr (a rule's log file), size thread pools to the job's cores (torch's too, unless the
    job computes nothing itself), and merge the `stage`'s run-only settings into `args.settings`."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    merge_run_settings(args, stage)
    if torch_threads:
        import torch  # here, not at the top: the status and plan scripts use this module without torch

        torch.set_num_threads(max(1, args.threads))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true" if args.threads > 1 else "false")


def merge_run_settings(args: argparse.Namespace, stage: str | None) -> None:
    """Merge the `stage`'s run-only settings (--run-settings, else the workflow's environment) into
    `args.settings`, once, and log them: they are in no rule's params, so the job's log is their record."""
    if getattr(args, "run_settings_merged", False):
        return
    if args.run_settings is None:
        args.run_settings = json.loads(os.environ.get(RUN_SETTINGS_ENV) or "{}").get(stage) or {}
    if args.run_settings:
        logging.getLogger("settings").info("run settings: %s", json.dumps(args.run_settings, sort_keys=True))
        args.settings = merged(args.settings, args.run_settings)
    args.run_settings_merged = True


def run_snakemake(args: list[str], retry_when: str | None = None, attempts: int = 3) -> str:
    """stdout of this environment's snakemake (whether or not it is on PATH); exits with its output on failure.

    A failure whose output contains `retry_when` is retried, up to `attempts` runs in all.
    """
    for attempt in range(attempts):
        proc = subprocess.run([str(Path(sys.executable).parent / "snakemake"), *args], capture_output=True, text=True)
        retry = proc.returncode != 0 and retry_when is not None and retry_when in proc.stdout + proc.stderr
        if not retry or attempt == attempts - 1:
            break
        time.sleep(1)
    if proc.returncode != 0:
        reasons = failure_reasons(proc.stdout + "\n" + proc.stderr)
        raise SnakemakeFailed("\n".join([f"snakemake {' '.join(args)} failed: {reasons[0]}", *reasons[1:]]))
    return proc.stdout


def failure_reasons(output: str) -> list[str]:
    """What a failed Snakemake run says went wrong: each failed job's reason (the `error:` line the rules
    print), else its last lines (a config or preflight error)."""
    errors = [line.removeprefix("error: ") for line in output.splitlines() if line.startswith("error: ")]
    return errors or [line for line in output.strip().splitlines()[-15:] if line.strip()] or ["no output"]
