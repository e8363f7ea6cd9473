#!/usr/bin/env python
"""Regenerate the assistant turns of prompt shards with the configured backend.

Several --prompts/--out/--stats triples are answered in turn; with a launched SGLang server,
one job serves every shard of the partitions that use it.
"""

import logging
import sys

from eagle3_datagen import cli
from eagle3_datagen.stages.responses.job import JobError, run_response_job


def main() -> None:
    p = cli.parser(__doc__)
    p.add_argument("--prompts", nargs="+", required=True)
    p.add_argument("--out", nargs="+", required=True)
    p.add_argument("--stats", nargs="+", required=True)
    p.add_argument("--server-log", help="where a launched SGLang server writes its output")
    args = p.parse_args()
    cli.setup(args)
    if not len(args.prompts) == len(args.out) == len(args.stats):
        p.error("--prompts, --out and --stats need one path per shard each")
    try:
        run_response_job(list(zip(args.prompts, args.out, args.stats, strict=True)), args.settings, args.server_log)
    except JobError as e:
        logging.getLogger("responses").error("%s", e)
        sys.exit(1)


if __name__ == "__main__":
    main()
