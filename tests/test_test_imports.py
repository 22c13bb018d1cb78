"""No test module imports another test module: what two of them share lives in a helper module of tests/
(zs_common.py, checkpoint_helpers.py, hf_models.py, ...), under a public name. A test module that
imports another one runs that module's import-time work and skips, and ties its cases to the other
module's private names. Lazy imports inside functions count as much as top-level ones."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _test_module_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in `path` of a test module of tests/ (`test_*`), relative or not."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):  # `from .x import y` inside tests/ is `from tests.x import y`
            base = ("tests" + (f".{node.module}" if node.module else "")) if node.level == 1 else node.module or ""
            names = [f"{base}.{alias.name}" for alias in node.names] if base == "tests" else [base]
        else:
            continue
        found += [(node.lineno, n) for n in names if n.startswith("tests.test_")]
    return found


def test_no_test_module_imports_another():
    problems = [
        f"{path.name}:{line} imports {module}"
        for path in sorted(TESTS.glob("test_*.py"))
        for line, module in _test_module_imports(path)
    ]
    assert not problems, "move what they share into a helper module of tests/:\n" + "\n".join(problems)


def test_the_checker_finds_every_form(tmp_path):
    source = tmp_path / "test_x.py"
    source.write_text(
        "import tests.test_a\n"
        "from tests.test_b import f\n"
        "from tests import test_c, zs_common\n"
        "from .test_d import g\n"
        "from . import test_e\n"
        "def h():\n"
        "    from tests.test_f import _private\n"
        "from tests.zs_common import make_config\n"
    )
    modules = sorted(module for _, module in _test_module_imports(source))
    assert modules == [f"tests.test_{x}" for x in "abcdef"], modules
