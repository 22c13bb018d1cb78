"""The layers of the package, read from the source (docs/architecture.md, "Layers").

Imports run one way: tools and integrations -> compat -> inference -> checkpoint / offload -> core ->
config. A module may import its own layer and the layers strictly below it; nothing imports the
facade (`zeroshard/__init__.py`). Inside a layer too, no module reaches itself through imports. Lazy
imports inside functions, and type-only ones, count as much as top-level ones.

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

RANK = {
    "version": 0,
    "config": 0,
    "core": 1,
    "offload": 2,
    "checkpoint": 2,
    "inference": 3,
    "compat": 4,
    "integrations": 5,
    "tools": 5,
}


def _layer(module: str) -> str | None:
    """'zeroshard.core.unit' -> 'core'; the facade 'zeroshard' -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path, name: str | None = None) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, names taken from it) of every zeroshard import in `path` (module
    `name`, default: from its place in the package), relative ones resolved; `import m` takes no names."""
    tree = ast.parse(path.read_text(), str(path))
    here = (name or _module_name(path)).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] == "zeroshard"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] == "zeroshard":
                found.append((node.lineno, module, [alias.name for alias in node.names]))
    return found


def _imports(path: Path, name: str | None = None) -> list[tuple[int, str]]:
    """(line, absolute module) of every zeroshard import in `path`; `from zeroshard import x` counts
    as importing `zeroshard.x`, a submodule or a facade name."""
    found = []
    for line, module, names in _imported(path, name):
        if module == "zeroshard" and names:
            found += [(line, f"zeroshard.{n}") for n in names]
        else:
            found.append((line, module))
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


def _graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules it imports, lazily or not. `from p import x`, where `p.x` is a module,
    imports `p.x`; importing a module is not counted as importing the packages above it, since a
    package's `__init__` that re-exports its submodules would otherwise close a circle with each."""
    graph = {}
    for module, path in files.items():
        targets = set()
        for _, imported, names in _imported(path, module):
            subs = [f"{imported}.{n}" for n in names]
            targets |= {s for s in subs if s in files}
            if not names or any(s not in files for s in subs):
                targets.add(imported)
        graph[module] = (targets & files.keys()) - {module}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected component of more than one module (Tarjan, 1972), sorted."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component, top = set(), None
            while top != node:
                top = stack.pop()
                on_stack.discard(top)
                component.add(top)
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(sorted(c) for c in components)


def _circle_through(start: str, component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """The shortest import chain from `start` back to itself inside `component` (breadth first)."""
    came_from, frontier = {}, [start]
    while start not in came_from:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & component):
                if nxt not in came_from:
                    came_from[nxt] = node
                    following.append(nxt)
        frontier = following
    chain = [start, came_from[start]]
    while chain[-1] != start:
        chain.append(came_from[chain[-1]])
    return chain[::-1]


def test_no_import_circles():
    """No module reaches itself through imports, lazy or type-only ones included: a circle means two
    modules each hold what the other needs, and that shared part belongs in a third."""
    files = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    graph = _graph(files)
    found = []
    for members in _circles(graph):
        circle = _circle_through(members[0], set(members), graph)
        rest = [m for m in members if m not in circle]
        found.append(" -> ".join(circle) + (f"  (and through {', '.join(rest)})" if rest else ""))
    assert not found, "import circles:\n" + "\n".join(found)


def test_the_circle_finder_can_fail():
    graph = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": set(), "e": {"f"}, "f": {"e"}}
    assert _circles(graph) == [["a", "b", "c"], ["e", "f"]]
    assert _circle_through("a", {"a", "b", "c"}, graph) == ["a", "b", "c", "a"]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_the_import_graph_resolves_submodules_and_hidden_imports(tmp_path):
    """`from p import x` reaches module `p.x` where there is one, else `p`; imports in functions and
    under TYPE_CHECKING are edges too."""
    package = tmp_path / "a"
    package.mkdir()
    files = {
        "zeroshard.a": package / "__init__.py",
        "zeroshard.a.b": package / "b.py",
        "zeroshard.a.c": package / "c.py",
    }
    files["zeroshard.a"].write_text("from . import b\n")
    files["zeroshard.a.b"].write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n")
    files["zeroshard.a.c"].write_text("def f():\n    from zeroshard.a import b, NAME\n")
    graph = _graph(files)
    assert graph == {
        "zeroshard.a": {"zeroshard.a.b"},
        "zeroshard.a.b": {"zeroshard.a.c"},
        "zeroshard.a.c": {"zeroshard.a", "zeroshard.a.b"},
    }
    assert _circles(graph) == [["zeroshard.a", "zeroshard.a.b", "zeroshard.a.c"]]


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
