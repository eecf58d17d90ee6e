# Two commands on a fresh clone, with only Python (3.10+) present; each sets itself up on first use:
#   make run    # the whole pipeline on the embedded default (configs/tiny.yaml), CPU, local MLflow store
#   make test   # the test suite (GPU and Slurm tests skip where there is none)
# Extra arguments pass through: make run ARGS="--config configs/tiny-raw.yaml", make test ARGS="-k dag".
# The first call creates .venv and installs the project; later calls reuse it (reinstalling only when
# pyproject.toml changes). TORCH picks the torch to install: the default is the CPU build this project is
# tested with; on a GPU box install your CUDA torch into .venv first and pass TORCH= (empty).

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
ARGS ?=
RUNTIME := $(VENV)/.installed-run
DEV := $(VENV)/.installed-dev

.PHONY: run test lint setup

run: $(RUNTIME)
	$(VENV)/bin/drafter run $(ARGS)

test: $(DEV)
	$(VENV)/bin/pytest $(ARGS)

lint: $(DEV)
	$(VENV)/bin/ruff check pipeline jobs tests

setup: $(DEV)

# `make run` installs what the pipeline needs; `make test` adds the test tools (the dev extra) on top.
$(RUNTIME): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q $(TORCH) -e .
	touch $@

$(DEV): $(RUNTIME)
	$(VENV)/bin/pip install -q $(TORCH) -e ".[dev]"
	touch $@
