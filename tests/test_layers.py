"""The layers of the package, read from the source (docs/architecture.md, "Layers").

Imports run one way: tools and integrations -> compat -> checkpoint / offload -> core -> config. A
module may import its own layer and the layers strictly below it; nothing imports the facade
(`zeroshard/__init__.py`). Lazy imports inside functions count as much as top-level ones.

Notes hold: a note is defined by its heading, such as `[Note: unit states]`, at the start of a line of
the code or the tests (after `#`, a docstring's quotes or `--`); every other such bracket, there or in
benchmarks, examples, scripts and docs, cites a note and must name one that is defined.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "src" / "zeroshard"

RANK = {"version": 0, "config": 0, "core": 1, "offload": 2, "checkpoint": 2, "compat": 3, "integrations": 4, "tools": 4}


def _layer(module: str) -> str | None:
    """'zeroshard.core.unit' -> 'core'; the facade 'zeroshard' -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str | None = None) -> list[tuple[int, str]]:
    """(line, absolute module) of every zeroshard import in `path` (module `name`, default: from
    its place in the package), relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    here = (name or _module_name(path)).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] == "zeroshard"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != "zeroshard":
                continue
            if module == "zeroshard":  # `from zeroshard import x`: x is a submodule or a facade name
                found += [(node.lineno, f"zeroshard.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, module))
    return found


SOURCES = sorted(p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py")


def test_every_module_belongs_to_a_layer():
    assert {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in SOURCES} <= set(RANK)


def test_imports_run_one_way():
    wrong = []
    for path in SOURCES:
        mine = _layer(_module_name(path))
        for line, module in _imports(path):
            theirs = _layer(module)
            if theirs is None or theirs not in RANK:
                wrong.append(
                    f"{path.relative_to(PACKAGE)}:{line} imports the facade ({module}); import the layer module"
                )
            elif theirs != mine and RANK[theirs] >= RANK[mine]:
                wrong.append(
                    f"{path.relative_to(PACKAGE)}:{line} ({mine}) imports {module} ({theirs}), which is not below it"
                )
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_the_checker_resolves_relative_and_lazy_imports(tmp_path):
    """The checker itself: relative imports are resolved and imports inside functions are seen."""
    assert _module_name(PACKAGE / "core" / "unit.py") == "zeroshard.core.unit"
    probe = tmp_path / "probe.py"
    probe.write_text("from ..tools import cli\ndef f():\n    from zeroshard.compat.engine import ZeroEngine\n")
    found = sorted(_imports(probe, "zeroshard.core.probe"))
    assert found == [(1, "zeroshard.tools"), (3, "zeroshard.compat.engine")]
    assert [_layer(m) for _, m in found] == ["tools", "compat"]


def _redefined(source: str) -> list[str]:
    """Top-level functions and classes a module defines twice: the second silently replaces the first."""
    seen, twice = set(), []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name in seen:
                twice.append(f"{node.name} (line {node.lineno})")
            seen.add(node.name)
    return twice


def test_no_module_defines_a_name_twice():
    twice = {str(p.relative_to(PACKAGE)): names for p in SOURCES if (names := _redefined(p.read_text()))}
    assert not twice, f"defined twice (the later one wins, callers of the first break): {twice}"
    assert _redefined("def f():\n    pass\n\n\ndef f():\n    pass\n") == ["f (line 5)"], "the check can fail"


NOTE = re.compile(r"\[Note[:] ([^\]]+)\]")  # "[:]", so that the pattern is no citation itself
HEADING = re.compile(r'^\s*(?:#\s*)?(?:r?"""\s*)?(?:--\s*)?' + NOTE.pattern)
CITING = ["src/**/*.py", "tests/**/*.py", "benchmarks/**/*.py", "examples/**/*.py", "scripts/**/*.py"]
CITING += ["docs/**/*.md", "benchmarks/**/*.md", "examples/**/*.md", "README.md"]


def _notes(text: str, defines: bool) -> tuple[set[str], list[tuple[int, str]]]:
    """(names whose heading `text` holds, (line, name) of each citation). Where `text` may not define
    notes (`defines` false), a heading is one more citation."""
    headings, cited = set(), []
    for number, line in enumerate(text.splitlines(), 1):
        heading = HEADING.match(line) if defines else None
        if heading:
            headings.add(heading[1])
        cited += [(number, m[1]) for m in NOTE.finditer(line, heading.end() if heading else 0)]
    return headings, cited


def test_every_cited_note_exists():
    """Code and tests define notes (a test's own reasons live beside it); the rest only cite them."""
    files = sorted({p for pattern in CITING for p in REPO.glob(pattern)})
    read = {
        p: _notes(p.read_text(), p.suffix == ".py" and p.relative_to(REPO).parts[0] in ("src", "tests")) for p in files
    }
    defined = set().union(*(headings for headings, _ in read.values()))
    missing = [
        f"{p.relative_to(REPO)}:{line} {name!r}"
        for p, (_, cited) in read.items()
        for line, name in cited
        if name not in defined
    ]
    assert not missing, "cited notes that no heading defines:\n" + "\n".join(missing)
    opening = "[Note: "  # <x> below is note x's bracket, written so that this file cites no note
    text = '"""<a> why.\n\n<b> too."""\nx = 1  # <a>, <c>\n'.replace("<", opening).replace(">", "]")
    assert _notes(text, defines=True) == ({"a", "b"}, [(4, "a"), (4, "c")]), "the check can fail"
    assert _notes(text, defines=False) == (set(), [(1, "a"), (3, "b"), (4, "a"), (4, "c")])
