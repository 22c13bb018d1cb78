# Every target builds .venv from a bare Python 3.11 first. torch is pinned: the CPU wheel of
# 2.13.0 lies on this machine's disk, an unpinned torch would pull a multi-GB CUDA build.
PYTHON ?= python3.11
# Bytecode caches stay on, even where the environment turns them off (PYTHONDONTWRITEBYTECODE): else
# every pytest worker rewrites and compiles every test module again, and every rank process a test
# starts compiles zeroshard's modules again (collection times: docs/bench/test_suite.txt).
unexport PYTHONDONTWRITEBYTECODE
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test test-fast coverage lint docs demo bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[dev,plot,hf,lightning,docs,lowbit]'
	touch $(STAMP)

# The suite on TEST_WORKERS pytest processes (pytest-xdist; a module's tests stay on one worker, so
# that its module-scoped fixtures run once), then the tests marked `serial` alone: their bounds in
# wall-clock seconds must not count another worker's load. Three workers on CI's 2 cores: a test's
# ranks wait at times (rendezvous, timeouts, files), and a third worker computes meanwhile
# (docs/bench/test_suite.txt: phase 1 took 473 s with 3 workers, 521 s with 2).
TEST_WORKERS ?= 3
SERIAL_TESTS := tests/test_multinode.py  # the modules holding tests marked `serial` (tests/test_harness.py checks)

test: venv
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not serial"
	$(BIN)/python -m pytest -q -m serial $(SERIAL_TESTS)

test-fast: venv
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow"

# The suite under coverage.py ([tool.coverage] in pyproject.toml); the report lists src/ by file.
coverage: venv
	rm -f .coverage .coverage.*
	$(BIN)/coverage run -m pytest -q
	$(BIN)/coverage combine -q
	$(BIN)/coverage report

# ruff (lint, then formatting), mypy and the strict docs build; settings in pyproject.toml
# ([tool.ruff], [tool.mypy]) and mkdocs.yml.
lint: venv
	$(BIN)/ruff check src tests benchmarks examples scripts
	$(BIN)/ruff format --check src tests benchmarks examples scripts
	$(BIN)/mypy src
	$(MAKE) docs

# The user guide into site/. --strict: a broken link or anchor, an API reference that does not resolve
# or a stale docs/config_reference.md fails the build. NO_MKDOCS_2_WARNING silences mkdocs-material's
# banner about its successor, which is not a warning about this site.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

demo: venv
	$(BIN)/zeroshard train

bench: venv
	$(BIN)/zeroshard bench

clean:
	rm -rf $(VENV) build site *.egg-info src/*.egg-info
