"""A stand-in for `nvidia-smi --query-gpu` and `--query-compute-apps` (CSV, no header, no units), for the
GPU handover tests on a machine without a GPU: the GPUs and the processes holding their memory come from
the JSON file $E3DG_NVIDIA_SMI_STATE, each holder until its `freed_at` (epoch seconds; null: never).

    {"gpus": [{"index": 0, "uuid": "GPU-0", "total": 81559}],
     "holders": [{"pid": 4242, "name": "sglang::scheduler", "used": 70000, "gpu": "GPU-0", "freed_at": null}]}

Installed on PATH as `nvidia-smi` by the `stand_in_nvidia_smi` fixture (tests/unit/conftest.py).
"""

import json
import os
import sys
import time


def main() -> None:
    with open(os.environ["E3DG_NVIDIA_SMI_STATE"]) as f:
        state = json.load(f)
    now = time.time()
    holding = [h for h in state["holders"] if h["freed_at"] is None or now < h["freed_at"]]
    query = next(a for a in sys.argv[1:] if a.startswith("--query-"))
    if query == "--query-gpu=index,uuid,memory.used,memory.total":
        for gpu in state["gpus"]:
            used = sum(h["used"] for h in holding if h["gpu"] == gpu["uuid"])
            print(f"{gpu['index']}, {gpu['uuid']}, {used}, {gpu['total']}")
    elif query == "--query-compute-apps=pid,process_name,used_memory,gpu_uuid":
        for h in holding:
            print(f"{h['pid']}, {h['name']}, {h['used']}, {h['gpu']}")
    else:
        sys.exit(f"the stand-in nvidia-smi does not answer {query}")


if __name__ == "__main__":
    main()
