#!/usr/bin/env bash
# Time the README's commands on a fresh clone: `make demo` (install included) and `make test`.
# Usage: bash bench/fresh_clone_demo.sh [--cold-cache] [--with-tests]
# --cold-cache gives uv an empty cache, so every package is downloaded as on a new machine.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git clone --quiet "$repo" "$work/clone"
cd "$work/clone"
if [[ " $* " == *" --cold-cache "* ]]; then export UV_CACHE_DIR="$work/uv-cache"; fi
/usr/bin/time -v make demo > "$work/demo.log" 2>&1 || { tail -40 "$work/demo.log"; exit 1; }
echo "make demo: $(grep 'Elapsed (wall' "$work/demo.log" | awk '{print $NF}') wall," \
  "peak RSS $(grep 'Maximum resident' "$work/demo.log" | awk '{printf "%.0f MB", $NF/1024}')"
if [[ " $* " == *" --with-tests "* ]]; then
  /usr/bin/time -v make test > "$work/test.log" 2>&1 || { tail -40 "$work/test.log"; exit 1; }
  echo "make test: $(grep 'Elapsed (wall' "$work/test.log" | awk '{print $NF}') wall;" \
    "$(grep -E '^[0-9]+ passed' "$work/test.log" | tail -1)"
fi
