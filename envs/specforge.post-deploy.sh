#!/usr/bin/env bash
# Run by Snakemake (--sdm conda) in the new envs/specforge.yaml env, from the workflow's directory: the
# complete pinned list, --no-deps, as `make specforge-env` installs it, and this package.
set -euo pipefail
python -m pip install --no-deps -r envs/specforge-cpu.txt
python -m pip install --no-deps -e .
