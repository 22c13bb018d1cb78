"""Skipping a module whose optional dependencies are missing, without importing them.

`pytest.importorskip` at a module's top imports the library while pytest collects, and every
pytest-xdist worker collects every module: transformers, PEFT, TRL and Lightning would be imported by
every worker, whether or not it runs the module (collection times: docs/bench/test_suite.txt). `needs` only asks whether the library is installed
(`importlib.util.find_spec`); the tests import it where they use it."""

from __future__ import annotations

import importlib.util

import pytest


def installed(module: str) -> bool:
    """Whether `module`'s top-level package is installed. Only the top level: finding a submodule
    imports its parents, and `lightning/__init__.py` alone imports all of Lightning."""
    return importlib.util.find_spec(module.partition(".")[0]) is not None


def needs(*modules: str, extra: str):
    """A module's `pytestmark`: skip its tests unless every one of `modules` is installed."""
    missing = [m for m in modules if not installed(m)]
    return pytest.mark.skipif(
        bool(missing), reason=f"needs {', '.join(missing)}: the [{extra}] extra installs it; `make test` does"
    )
