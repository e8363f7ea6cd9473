# `make demo` and `make test` work on a fresh clone: they create .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels)
export PATH := $(abspath $(VENV))/bin:$(PATH)
# Cache compiled bytecode: every job imports torch and transformers afresh.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install sglang-env speculators-env check-envs demo tiny-kimi test lint clean

install: $(VENV)/.installed

$(VENV)/.installed: envs/requirements.txt pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check uv==0.13.8
	$(VENV)/bin/uv pip install --quiet --python $(PY) $(FIND_LINKS) -r envs/requirements.txt
	$(VENV)/bin/uv pip install --quiet --python $(PY) --no-deps -e .
	touch $@

# SGLang 0.5.23 on the CPU, for the tests in tests/real_sglang (a second venv: SGLang pins transformers 5.19.0).
SGLANG_VENV ?= .venv-sglang
sglang-env: $(SGLANG_VENV)/.installed

$(SGLANG_VENV)/.installed: envs/sglang-cpu.txt pyproject.toml | install
	python3 -m venv $(SGLANG_VENV)
	$(VENV)/bin/uv pip install --quiet --python $(SGLANG_VENV)/bin/python --no-deps $(FIND_LINKS) -r envs/sglang-cpu.txt
	$(VENV)/bin/uv pip install --quiet --python $(SGLANG_VENV)/bin/python --no-deps -e .
	$(SGLANG_VENV)/bin/python -c "import torch, sys; sys.exit(torch.version.cuda and f'{torch.__version__}: a CUDA torch')"
	touch $@

# vLLM speculators 0.9.0 on the CPU, for the tests in tests/trainers (its own venv: it pins transformers<=5.19.0).
SPECULATORS_VENV ?= .venv-speculators
speculators-env: $(SPECULATORS_VENV)/.installed

$(SPECULATORS_VENV)/.installed: envs/speculators-cpu.txt pyproject.toml | install
	python3 -m venv $(SPECULATORS_VENV)
	$(VENV)/bin/uv pip install --quiet --python $(SPECULATORS_VENV)/bin/python --no-deps $(FIND_LINKS) -r envs/speculators-cpu.txt
	$(VENV)/bin/uv pip install --quiet --python $(SPECULATORS_VENV)/bin/python --no-deps -e .
	$(SPECULATORS_VENV)/bin/python -c "import torch, sys; sys.exit(torch.version.cuda and f'{torch.__version__}: a CUDA torch')"
	touch $@

# envs/sglang.yaml's pip pins resolve together (package metadata only: nothing is installed).
check-envs: install
	$(PY) -c "import yaml; deps = yaml.safe_load(open('envs/sglang.yaml'))['dependencies']; \
	print('\n'.join(p for d in deps if isinstance(d, dict) for p in d['pip'] if not p.startswith('-e')))" > .sglang-yaml.txt
	$(VENV)/bin/uv pip compile --quiet --python-version 3.11 --python-platform x86_64-manylinux_2_34 \
		.sglang-yaml.txt -o /dev/null; status=$$?; rm -f .sglang-yaml.txt; exit $$status

demo: install
	snakemake --profile profiles/local

tiny-kimi: install
	snakemake --profile local --configfile config/tiny-kimi.yaml

test: install sglang-env
	pytest -q
	$(SGLANG_VENV)/bin/python -m pytest -q -o addopts=-ra tests/real_sglang

lint: install
	ruff check src scripts tests
	snakefmt --check Snakefile rules
	snakemake --lint

clean:
	rm -rf results logs benchmarks .snakemake
