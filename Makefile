# Two commands on a fresh clone, with only Python (3.10+) present; each sets itself up on first use:
#   make run    # the whole pipeline on the embedded default (configs/tiny.yaml), CPU, local MLflow store
#   make test   # the test suite (GPU and Slurm tests skip where there is none)
# Extra arguments pass through: make run ARGS="--config configs/tiny-raw.yaml", make test ARGS="-k dag".
# The first call creates .venv and installs the project; later calls reuse it (reinstalling only when
# pyproject.toml changes). TORCH picks the torch to install: the default is the version this project is tested with
# (the CPU build where pip finds one, as PIP_FIND_LINKS does on the CI machine; PyPI's default Linux wheel is the CUDA
# build, which runs on a CPU too); on a GPU box install your CUDA torch into .venv first and pass TORCH= (empty).

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
ARGS ?=
# The installer: uv (installed into .venv by pip first; it resolves the same versions as pip and installs them in
# parallel: ~1.5 min here against ~4.5 for pip) or pip. uv does not read pip's configuration: the find-links pip
# is given in the environment (PIP_FIND_LINKS, where this machine's CPU torch wheel lies) are passed on, and if uv
# fails (an index only pip.conf names) pip installs instead. INSTALLER=pip skips uv.
INSTALLER ?= uv
RUNTIME := $(VENV)/.installed-run
DEV := $(VENV)/.installed-dev
UV_LINKS := $(foreach links,$(PIP_FIND_LINKS),--find-links $(links))
ifeq ($(INSTALLER),uv)
install = ($(VENV)/bin/pip install -q uv && $(VENV)/bin/uv pip install -q --compile-bytecode --python $(VENV)/bin/python $(UV_LINKS) $(1)) \
	|| $(VENV)/bin/pip install -q $(1)
else
install = $(VENV)/bin/pip install -q $(1)
endif

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
	@echo "make: installing $(or $(TORCH),your torch) and the pipeline into $(VENV) (once; 1-2 minutes, silent)"
	$(PYTHON) -m venv $(VENV)
	$(call install,$(TORCH) -e .)
	touch $@

$(DEV): $(RUNTIME)
	@echo "make: adding the test tools (pytest, ruff, triton, ...) to $(VENV) (once; under a minute, silent)"
	$(call install,$(TORCH) -e ".[dev]")
	touch $@
