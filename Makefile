# `make demo` and `make test` work on a fresh clone: they create .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels)
export PATH := $(abspath $(VENV))/bin:$(PATH)
# Cache compiled bytecode: every job imports torch and transformers afresh.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install demo tiny-kimi test lint clean

install: $(VENV)/.installed

$(VENV)/.installed: envs/requirements.txt pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check uv==0.13.8
	$(VENV)/bin/uv pip install --quiet --python $(PY) $(FIND_LINKS) -r envs/requirements.txt
	$(VENV)/bin/uv pip install --quiet --python $(PY) --no-deps -e .
	touch $@

demo: install
	snakemake --profile profiles/local

tiny-kimi: install
	snakemake --profile profiles/local --configfile config/tiny-kimi.yaml

test: install
	pytest -q

lint: install
	ruff check src scripts tests
	snakefmt --check Snakefile rules
	snakemake --lint

clean:
	rm -rf results logs benchmarks .snakemake
