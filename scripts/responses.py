#!/usr/bin/env python
"""Regenerate the assistant turns of prompt shards with the configured backend.

Several --prompts/--out/--stats triples are answered in turn. With a launched SGLang server, the
job uses the node's shared server (started by the first shard job on the node, stopped when idle).
Another copy of the same job (a restarted controller's) waits until this one is done.
"""

from eagle3_datagen import cli
from eagle3_datagen.backends.plugins import GENERATION
from eagle3_datagen.formats.shard_lease import one_copy
from eagle3_datagen.stages.responses.job import JobError, run_response_job


def main() -> None:
    p = cli.parser(__doc__)
    p.add_argument("--prompts", nargs="+", required=True)
    p.add_argument("--out", nargs="+", required=True)
    p.add_argument("--stats", nargs="+", required=True)
    p.add_argument("--server-log", help="where a launched SGLang server writes its output")
    args = p.parse_args()
    cli.setup(args, "responses", torch_threads=GENERATION[args.settings["backend"]].in_process)  # computes here
    if not len(args.prompts) == len(args.out) == len(args.stats):
        p.error("--prompts, --out and --stats need one path per shard each")
    shards = list(zip(args.prompts, args.out, args.stats, strict=True))
    with one_copy([*args.out, *args.stats], args.prompts) as done:
        if not done:
            run_response_job(shards, args.settings, args.server_log, args.run_settings)


if __name__ == "__main__":
    cli.run(main, (JobError,))
