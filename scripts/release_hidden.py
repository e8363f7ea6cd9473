#!/usr/bin/env python
"""Remove the parts of a partition's hidden-state shards once its exports and probes have read them.

Run by the workflow's release_hidden rule (hidden_states.keep_shards: false, the default, and the partition
has an export): each shard keeps its index.json and gains a released.json, which keeps what its probe measured;
each export is linked into results/<partition>/hidden/kept/<format>, the run's one copy of the states, from
which a later change to the export rebuilds it. Writes --out with the shards, the bytes this run freed, the
bytes every release of them freed (a rerun frees none) and the kept copies.
"""

import logging
from pathlib import Path

from eagle3_datagen import cli
from eagle3_datagen.formats.files import read_json, write_json
from eagle3_datagen.formats.hidden_shard import release_parts
from eagle3_datagen.formats.released import RELEASED
from eagle3_datagen.stages.export.kept import keep


def main() -> None:
    p = cli.parser(__doc__, stage_settings=False)
    p.add_argument("--hidden", nargs="+", required=True, help="the partition's hidden-state shard directories")
    p.add_argument("--after", nargs="+", required=True, help="the outputs made from them (exports, probes)")
    p.add_argument("--out", required=True, help="the record to write (JSON)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    after = [Path(path) for path in args.after]
    probes = {path.stem: read_json(path) for path in after if path.parent.name == "probe"}
    kept = [str(copy) for copy in (keep(path) for path in after if path.parent.name == "export") if copy]
    freed = {shard: release_parts(shard, args.after, probes.get(Path(shard).name)) for shard in args.hidden}
    # A rerun (an export rebuilt from the kept copy) frees nothing: each shard's released.json, written once,
    # keeps what its first release freed.
    released = sum(read_json(Path(shard) / RELEASED)["bytes"] for shard in args.hidden)
    record = {"shards": freed, "bytes_freed": sum(freed.values()), "bytes_released": released}
    write_json(args.out, {**record, "after": args.after, "kept": kept})
    logging.getLogger("release").info("removed the parts of %d shards: %d bytes freed", len(freed), sum(freed.values()))


if __name__ == "__main__":
    cli.run(main)
