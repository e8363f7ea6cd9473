#!/usr/bin/env bash
# The evaluate stage's training on a GPU, as one prepared run on a machine with one CUDA GPU and a
# finished workflow with an `evaluate` section (`make tiny-kimi`, `make demo`) copied into results/:
#   1. SpecForge 0.2.0's Triton loss kernel against the reference the CPU path trains with
#      (scripts/loss_kernel_check.py);
#   2. the draft over all partitions trained with `specforge train` as released on the GPU
#      (evaluate.device: cuda) and, on the same machine, with the CPU path's substitutions
#      (evaluate.device: cpu), each measured on the same held-out samples (scripts/evaluate.py).
# Usage: bench/gpu_evaluate.sh WHEELS OUT. WHEELS holds SpecForge 0.2.0 and the pins of
# envs/specforge-cpu.txt the machine's Python lacks, installed (pip --target) ahead of its own packages,
# over its CUDA torch (SpecForge pins torch 2.11.0); OUT receives the figures and logs. BENCHMARKS.md gives the numbers and the command.
set -euo pipefail
wheels=$1 out=$2
site=/tmp/specforge-site
python3 -m pip install -q --no-index --no-deps --no-cache-dir --target "$site" "$wheels"/*.whl
export PYTHONPATH=$site:$PWD/src PYTHONUNBUFFERED=1
# the evaluate stage runs the `specforge` beside its interpreter
ln -sf "$site/bin/specforge" "$(dirname "$(python3 -c 'import sys; print(sys.executable)')")/specforge"
python3 -c "import torch, transformers, specforge, triton; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, torch.cuda.get_device_name(), 'transformers', transformers.__version__, 'triton', triton.__version__)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

python3 scripts/loss_kernel_check.py --out "$out/loss_kernel.json" || echo "the loss kernel disagrees: see loss_kernel.json"

# Every partition's export but the baseline twins' (P+original), with its token shards and held-out ids.
exports=() tokens=() holdouts=()
for export in results/*/export/specforge; do
    partition=${export#results/} partition=${partition%%/*}
    [[ $partition == *+original ]] && continue
    exports+=("$export") holdouts+=("results/$partition/evaluate/holdout.json") tokens+=(results/"$partition"/tokens/*.jsonl.zst)
done
# The exports name the target, the draft config and the vocabulary by the absolute paths they were
# written under: that checkout is this one here.
target=$(sed -n 's/^ *target_model_path: *//p' "${exports[0]}/specforge.yaml")
written_in=${target%/results/*}
if [ ! -e "$written_in" ]; then mkdir -p "$(dirname "$written_in")" && ln -s "$PWD" "$written_in"; fi
settings=$(python3 -c "import json; s = json.load(open('results/evaluate/acceptance.json'))['settings']; \
print(json.dumps({k: v for k, v in s.items() if k not in ('device', 'python')}))")
for device in cuda cpu; do
    start=$(date +%s)
    python3 scripts/evaluate.py --partition all \
        --export "${exports[@]}" --tokens "${tokens[@]}" --holdout "${holdouts[@]}" \
        --settings "$settings" --run-settings "{\"device\": \"$device\"}" \
        --draft "/tmp/draft-$device" --out "$out/acceptance-$device.json" 2>"$out/evaluate-$device.log" ||
        { tail -40 "$out/evaluate-$device.log"; exit 1; }
    echo "$device: $(($(date +%s) - start)) s"
done
python3 - "$out" <<'EOF'
import json, sys
for device in ("cuda", "cpu"):
    f = json.load(open(f"{sys.argv[1]}/acceptance-{device}.json"))
    t = f["trainer_estimate"]
    print(device, "acceptance", round(f["acceptance_length"], 4), f["interval_95"], "estimate",
          round(t["acceptance_length"], 4), "by position", f["acceptance_by_position"])
EOF
