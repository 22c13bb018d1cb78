# Every target builds .venv from a bare Python 3.11 first. torch is pinned: the CPU wheel of
# 2.13.0 lies on this machine's disk, an unpinned torch would pull a multi-GB CUDA build.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test test-fast lint demo bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[dev,plot,hf,lightning]'
	touch $(STAMP)

test: venv
	$(BIN)/python -m pytest -q

test-fast: venv
	$(BIN)/python -m pytest -q -m "not slow"

# ruff (lint, then formatting) and mypy; settings in pyproject.toml ([tool.ruff], [tool.mypy]).
lint: venv
	$(BIN)/ruff check src tests benchmarks examples scripts
	$(BIN)/ruff format --check src tests benchmarks examples scripts
	$(BIN)/mypy src

demo: venv
	$(BIN)/zeroshard train

bench: venv
	$(BIN)/zeroshard bench

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
