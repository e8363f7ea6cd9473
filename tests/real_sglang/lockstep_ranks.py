"""One rank of tests/real_sglang/test_lockstep.py, started by torchrun: SGLang tp=2 on the CPU (gloo).

Captures the samples uninterrupted, then resumes the same capture from a work directory that holds
only its first two parts and their checksum files (a job killed mid-shard), with the same runner;
writes per rank how many forward passes each run made and whether it returned the index.
"""

import json
import shutil
import sys
from pathlib import Path

import torch.distributed as dist

from eagle3_datagen.backends.sglang.capture import load_sglang_capture
from eagle3_datagen.formats.hidden_shard import checksum_path
from eagle3_datagen.stages.hidden.shard import capture_shard


def main(model_dir: str, samples_path: str, out: str, settings_json: str) -> None:
    out, settings = Path(out), json.loads(settings_json)
    samples = json.loads(Path(samples_path).read_text())
    capture = load_sglang_capture(model_dir, "auto", "normed", settings["sglang"], False, settings["max_batch_tokens"])
    extends = []
    run = capture.runner.extend
    capture.runner.extend = lambda batch: extends.append(run(batch))
    report = {}
    for name in ("full", "resumed"):
        if name == "resumed" and capture.ranks.writer:
            partial = out / ".resumed.partial"
            partial.mkdir()
            # A killed job leaves each complete part beside its checksum file (index.json records
            # the checksums only once the shard is finished).
            recorded = {p["file"]: p["xxh3_64"] for p in json.loads((out / "full" / "index.json").read_text())["parts"]}
            for part in sorted((out / "full").glob("part-*"))[:2]:
                shutil.copy(part, partial / part.name)
                checksum_path(partial / part.name).write_text(recorded[part.name])
        dist.barrier()
        extends.clear()
        index = capture_shard(samples, out / name, capture, settings)
        report[name] = {"extends": len(extends), "index": index is not None}
    (out / f"report.{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
