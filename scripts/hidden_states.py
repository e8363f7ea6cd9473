#!/usr/bin/env python
"""Capture EAGLE-3 auxiliary and final hidden states for one token shard.

Before it writes anything, the job checks its shard's bytes against the room where --out goes (free
space, the user's quota, resources.disk_quota_bytes: workflow/disk.py) and refuses to start without it.
The forward passes run in the node's capture runner (scripts/capture_runner.py), which the first
hidden-state job on the node starts and the later ones reuse: the model loads once per node and run.
Another copy of the same job (a restarted controller's) waits until this one is done. A finished shard that
Snakemake removed to run its job again (a retried or requeued group job runs with --force) is linked back
from its `.finished` copy when what shapes its states is unchanged (stages/hidden/finished.py): nothing is
captured again. In one-pass mode (--states: hidden_states.one_pass, a vLLM partition) nothing runs a model:
the states its responses job staged are packed into the shard (backends/vllm/one_pass.py).
"""

import errno
import shutil
from pathlib import Path

from eagle3_datagen import cli
from eagle3_datagen.backends.vllm.one_pass import StagedStatesError
from eagle3_datagen.formats.files import DiskFull
from eagle3_datagen.formats.shard_lease import one_copy
from eagle3_datagen.stages.hidden.finished import keep_finished, restore_finished, states_fingerprint
from eagle3_datagen.stages.hidden.one_pass import pack_states
from eagle3_datagen.stages.hidden.runner import CaptureFailed, capture_with_runner
from eagle3_datagen.workflow.disk import capture_room_problem

RUNNER = Path(__file__).resolve().with_name("capture_runner.py")


def main() -> None:
    p = cli.parser(__doc__)
    p.add_argument("--tokens", required=True)
    p.add_argument("--out", required=True, help="shard directory to create")
    p.add_argument("--states", help="the shard's staged states (one pass): packed, not captured")
    args = p.parse_args()
    shaping = args.settings  # the rule's params: what shapes the states, before the run-only settings join them
    cli.setup(args, "hidden_states", torch_threads=False)  # the runner computes, with --threads
    problem = capture_room_problem(Path(args.tokens), Path(args.out), args.settings)
    if problem:
        raise DiskFull(errno.EDQUOT, problem)
    with one_copy([args.out], [args.tokens]) as done:
        # no token shard: the runner says so
        shaped_by = states_fingerprint(shaping, args.tokens) if Path(args.tokens).is_file() else None
        if not done and not (shaped_by and restore_finished(args.out, shaped_by)):
            if args.states:
                pack_states(args.tokens, args.states, args.out, args.settings["hidden_states"], args.settings["model"])
            else:
                capture_with_runner(args.tokens, args.out, args.settings, args.threads, RUNNER)
            if shaped_by:
                keep_finished(args.out, shaped_by)
        if args.states and Path(args.states).is_dir() and Path(args.out).is_dir():
            shutil.rmtree(args.states)  # the shard restored or written by another copy: it is the one copy


if __name__ == "__main__":
    cli.run(main, (CaptureFailed, StagedStatesError))
