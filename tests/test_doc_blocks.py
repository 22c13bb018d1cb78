"""Every fenced code block of README.md and of the guide (docs/**/*.md) is checked, in the way the HTML
comment on the line before its fence names (`<!-- doc-test: KIND ARGS -->`; comments do not render).
A block without a marker, or with a kind or prelude not listed here, fails `test_every_block_has_a_marker`.

| kind | block | what is checked |
|---|---|---|
| `run [PRELUDE ...]` | python | executed as written on 2 gloo ranks, every such block in one spawned group |
| `cli` | `zeroshard ...` | each command run by rank 0 (`zeroshard.tools.cli.main`) in the page's directory, exit status 0 |
| `parse` | shell commands | each command's arguments accepted by its program's own parser (below) |
| `command TEST` | shell command | TEST (`tests/x.py::test_y`) exists and names the command's program, scripts and `--flags` |
| `file PATH TEST` | python excerpt | its lines (indentation, trailing comments aside) appear in PATH in order; TEST (it runs PATH) names it |
| `script TEST` | titled block | TEST's module writes the page's titled blocks to files and runs this one, or one that reads it |
| `config` | json | accepted by `zeroshard.config.load_config` (a `"key": ...` fragment inside braces) |
| `make` | `make TARGET` | each target is a rule of the Makefile |
| `pip` | `pip install 'zeroshard[X]'` | each extra is declared in pyproject.toml |
| `layout DIR` | a directory tree | each listed directory exists under DIR, and every package under DIR is listed |
| `output TEST "TEXT"` | printed text | TEXT is in the block and in src/zeroshard; TEST's module checks it (up to its first colon) |
| `skip REASON` | anything | nothing; REASON says why it cannot run here |

`run`: the blocks of one page share a namespace, as in one interpreter reading the page top to bottom; it starts with `torch` and
`zeroshard` imported; the marker's preludes (`PRELUDES`) run before the block and provide the names a
fragment takes from its context (`model`, `engine`, `batches`, files such as `ds_config.json`). The
working directory is the page's own, shared by both ranks; the placeholder path `/local_nvme` is replaced
by a directory inside it. A prelude may also check what the block did (`AFTER`). `cli` blocks run in page
order among the `run` blocks, so `zeroshard consolidate ckpt ...` reads the checkpoint a block before saved.

`parse`: `zeroshard` goes to its CLI's parser; `torchrun` to torch's, and then its script's arguments to
that script; `python SCRIPT` / `python -m MODULE` runs the script with its `parse_args` (or
`parse_known_args`) stopped as soon as it returns, so the command's flags and values are checked without
running it. Continuation lines, `$ ` prompts, `VAR=value` prefixes, `sudo`, `for X in ...; do ...; done`
and variables the block assigns are unfolded first.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import json
import os
import re
import runpy
import shlex
import sys
import textwrap
from pathlib import Path

import pytest

from tests.harness import run_distributed, subtests

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<info>.*)$")
MARKER = re.compile(r"^\s*<!-- doc-test: (?P<kind>[\w-]+)(?P<args>.*?)\s*-->\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    info: str  # what follows the opening ```: language, attributes
    code: str  # dedented
    kind: str | None  # None: no marker
    args: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def title(self) -> str | None:
        match = re.search(r'title="([^"]+)"', self.info)
        return match.group(1) if match else None


def collect(pages=PAGES, root: Path = ROOT) -> list[Block]:
    blocks = []
    for page in pages:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            opening = FENCE.match(lines[i])
            if opening is None:
                i += 1
                continue
            end = i + 1
            while end < len(lines) and lines[end].strip() != "```":
                end += 1
            marker = MARKER.match(lines[i - 1]) if i else None
            blocks.append(
                Block(
                    page=str(page.relative_to(root)),
                    line=i + 1,
                    info=opening.group("info").strip(),
                    code=textwrap.dedent("\n".join(lines[i + 1 : end])) + "\n",
                    kind=marker.group("kind") if marker else None,
                    args=marker.group("args").strip() if marker else "",
                )
            )
            i = end + 1
    return blocks


BLOCKS = collect()
IN_GROUP = ("run", "cli")


# ---------------------------------------------------------------- shell commands


def commands(code: str) -> list[list[str]]:
    """The block's commands as argument lists (see the module docstring for what is unfolded)."""
    variables: dict[str, str] = {}
    out = []
    for raw in code.replace("\\\n", " ").splitlines():
        line = raw.strip().removeprefix("$ ")
        loop = re.fullmatch(r"for (\w+) in ([^;]+); do (.*); done(\s+#.*)?", line)
        bodies = [loop.group(3).replace(f"${loop.group(1)}", v) for v in loop.group(2).split()] if loop else [line]
        for body in bodies:
            for name, value in variables.items():
                body = body.replace(f"${name}", value)
            argv = shlex.split(body, comments=True)
            if len(argv) == 1 and (assignment := re.fullmatch(r"(\w+)=(.*)", argv[0], re.S)):
                variables[assignment.group(1)] = assignment.group(2)
                continue
            while argv and (re.fullmatch(r"\w+=.*", argv[0], re.S) or argv[0] == "sudo"):
                argv.pop(0)
            if argv:
                out.append(argv)
    return out


class _Parsed(Exception):
    def __init__(self, namespace, extra):
        super().__init__("parsed")
        self.namespace, self.extra = namespace, extra


@contextlib.contextmanager
def _stop_after_parsing(argv0: str, args: list[str], search_path: Path | None):
    """Within: the first (outermost) parse_args or parse_known_args raises _Parsed with what it parsed."""
    cls, inside = argparse.ArgumentParser, []
    originals = cls.parse_args, cls.parse_known_args

    def hook(original):
        def parse(self, *a, **kw):
            if inside:  # a sub-parser, or parse_args's own call of parse_known_args
                return original(self, *a, **kw)
            inside.append(self)
            try:
                result = original(self, *a, **kw)
            finally:
                inside.pop()
            namespace, extra = result if isinstance(result, tuple) else (result, [])
            raise _Parsed(namespace, extra)

        return parse

    saved_argv, saved_path = sys.argv, list(sys.path)
    cls.parse_args, cls.parse_known_args = hook(originals[0]), hook(originals[1])  # type: ignore[method-assign]
    sys.argv = [argv0, *args]
    if search_path is not None:
        sys.path.insert(0, str(search_path))
    try:
        yield
    finally:
        cls.parse_args, cls.parse_known_args = originals  # type: ignore[method-assign]
        sys.argv, sys.path[:] = saved_argv, saved_path


# What a script hands on the arguments its parse_known_args left: bandwidth_sweep.py runs
# `sweep_job.py --out OUT REST` (its sweep_job() builds that command).
HANDOFF = {"scripts/bandwidth_sweep.py": ("scripts/sweep_job.py", ["--out", "OUT"])}


def parse_script(target: str, args: list[str], *, module: bool = False) -> None:
    """Run `python [-m] target args` up to its argument parsing; raise AssertionError if it rejects them."""
    path = None if module else (ROOT / target)
    assert module or path.is_file(), f"{target}: no such script"
    try:
        with _stop_after_parsing(target, args, None if path is None else path.parent):
            if module:
                runpy.run_module(target, run_name="__main__", alter_sys=False)
            else:
                runpy.run_path(str(path), run_name="__main__")
    except _Parsed as parsed:
        if parsed.extra and target in HANDOFF:
            script, prefix = HANDOFF[target]
            return parse_script(script, [*prefix, *parsed.extra])
        assert not parsed.extra, f"{target} left arguments unparsed: {parsed.extra}"
        return None
    except SystemExit as exit_:
        raise AssertionError(f"{target} {shlex.join(args)}: its parser rejected the arguments ({exit_})") from None
    raise AssertionError(f"{target} ran to the end without parsing arguments")


def parse_command(argv: list[str]) -> None:
    program, args = Path(argv[0]).name, argv[1:]
    if program == "zeroshard":
        parse_script("zeroshard.tools.cli", args, module=True)
    elif program == "torchrun":
        from torch.distributed.run import get_args_parser

        launched = get_args_parser().parse_args(args)
        parse_script(launched.training_script, launched.training_script_args, module=launched.module)
    elif re.fullmatch(r"python[\d.]*", program):
        if args[0] == "-m":
            parse_script(args[1], args[2:], module=True)
        else:
            parse_script(args[0], args[1:])
    else:
        raise AssertionError(f"{shlex.join(argv)}: no parser known for {program!r}")


# ---------------------------------------------------------------- the checks of one block, by kind


def source_of(spec: str, *, whole_module: bool = False) -> str:
    """The source of test `tests/x.py::test_y` (or of its whole module); AssertionError if it is missing."""
    file, _, name = spec.partition("::")
    path = ROOT / file
    assert path.is_file() and name, f"{spec}: expected tests/<file>.py::<test function>"
    source = path.read_text()
    found = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == name]
    assert found, f"{spec}: {file} defines no function {name}"
    return source if whole_module else ast.get_source_segment(source, found[0]) or ""


def _code_lines(text: str) -> list[str]:
    """Lines without indentation and trailing comments; blank and comment-only lines dropped."""
    lines = (re.sub(r"\s+#.*$", "", line).strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def check_command(block: Block, spec: str) -> None:
    source = source_of(spec)
    aliases = {"torchrun": "torch.distributed.run"}
    for argv in commands(block.code):
        words = [aliases.get(argv[0], argv[0]) if argv[0] != "python" else "sys.executable"]
        words += [Path(a).name for a in argv if a.endswith((".py", ".json"))]
        words += [a.split("=")[0] for a in argv if a.startswith("--")]
        missing = [w for w in words if w not in source]
        assert not missing, f"{spec} does not name {missing} of `{shlex.join(argv)}`"


def check_file(block: Block, path: str, spec: str) -> None:
    target = _code_lines((ROOT / path).read_text())
    at = 0
    for line in _code_lines(block.code):
        assert line in target[at:], f"{path} has no line `{line}` (after the block's previous ones)"
        at = target.index(line, at) + 1
    assert Path(path).name in source_of(spec), f"{spec} does not name {path}"


def check_script(block: Block, spec: str) -> None:
    assert block.title, 'a `script` block needs a title="FILE" attribute'
    module = source_of(spec, whole_module=True)
    reads = "title=" in module or "write_titled_blocks" in module  # tests.harness.write_titled_blocks
    assert Path(block.page).name in module and reads, f"{spec} does not read {block.page}'s titles"
    titled = {b.title: b for b in BLOCKS if b.page == block.page and b.title and b.title in module}
    users = [t for t, b in titled.items() if t == block.title or block.title in b.code]
    assert users, f"{spec} runs no script that is, or reads, {block.title}"


def check_config(block: Block) -> None:
    from zeroshard.config import load_config

    try:
        config = json.loads(block.code)
    except json.JSONDecodeError:
        config = json.loads("{" + block.code + "}")  # a fragment: "key": value
    load_config(config, world_size=2)


def check_make(block: Block) -> None:
    rules = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    for argv in commands(block.code):
        assert argv[0] == "make" and set(argv[1:]) <= rules, f"`{shlex.join(argv)}`: the Makefile's rules are {rules}"


def check_pip(block: Block) -> None:
    section = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1].split("\n[")[0]
    extras = re.findall(r"^([\w-]+) = \[", section, re.M)  # no tomllib: Python 3.10 is supported
    for argv in commands(block.code):
        assert argv[:2] == ["pip", "install"], argv
        for requirement in argv[2:]:
            wanted = re.fullmatch(r"zeroshard\[([\w,-]+)\]", requirement)
            assert wanted, f"{requirement}: expected zeroshard[EXTRA]"
            assert set(wanted.group(1).split(",")) <= set(extras), f"{requirement}: the extras are {sorted(extras)}"


def check_layout(block: Block, directory: str) -> None:
    listed = {m.group(1) for m in re.finditer(r"^\s+([\w.]+)/", block.code, re.M)}
    packages = {p.parent.name for p in (ROOT / directory).glob("*/__init__.py")}
    assert listed == packages, f"listed {sorted(listed)}, the packages of {directory} are {sorted(packages)}"


def check_output(block: Block, spec: str, text: str) -> None:
    assert text in block.code, f"{text!r} is not in the block"
    sources = (p.read_text() for p in (ROOT / "src" / "zeroshard").rglob("*.py"))
    assert any(text in s for s in sources), f"nothing in src/zeroshard writes {text!r}"
    head = re.split(r"[:,]", text)[0]
    assert head in source_of(spec, whole_module=True), f"{spec} does not check {head!r}"


def check_static(block: Block) -> None:
    args = shlex.split(block.args) if block.kind in ARITY else []
    match block.kind:
        case "parse":
            for argv in commands(block.code):
                parse_command(argv)
        case "command":
            check_command(block, *args)
        case "file":
            check_file(block, *args)
        case "script":
            check_script(block, *args)
        case "config":
            check_config(block)
        case "make":
            check_make(block)
        case "pip":
            check_pip(block)
        case "layout":
            check_layout(block, *args)
        case "output":
            check_output(block, *args)
        case "skip":
            pytest.skip(f"{block.where}: {block.args}")
        case _:
            raise AssertionError(f"{block.where}: unknown kind {block.kind!r}")


KINDS = {"run", "cli", "parse", "command", "file", "script", "config", "make", "pip", "layout", "output", "skip"}
ARITY = {"command": 1, "file": 2, "script": 1, "layout": 1, "output": 2}


def test_every_block_has_a_marker():
    from tests import doc_preludes

    problems = []
    for b in BLOCKS:
        if b.kind is None:
            problems.append(f"{b.where}: no <!-- doc-test: KIND ... --> on the line before the fence")
        elif b.kind not in KINDS:
            problems.append(f"{b.where}: unknown kind {b.kind!r}; known: {sorted(KINDS)}")
        elif b.kind in ARITY and len(shlex.split(b.args)) != ARITY[b.kind]:
            problems.append(f"{b.where}: `{b.kind}` takes {ARITY[b.kind]} arguments, got {b.args!r}")
        elif b.kind == "skip" and not b.args:
            problems.append(f"{b.where}: `skip` needs its reason")
        elif b.kind == "run" and (unknown := set(b.args.split()) - set(doc_preludes.PRELUDES)):
            problems.append(f"{b.where}: unknown preludes {sorted(unknown)}; known: {sorted(doc_preludes.PRELUDES)}")
    assert not problems, "\n".join(problems)


STATIC = [b for b in BLOCKS if b.kind not in (*IN_GROUP, None)]


@pytest.mark.parametrize("block", STATIC, ids=[b.where for b in STATIC])
def test_block(block: Block):
    check_static(block)


# ---------------------------------------------------------------- run and cli blocks, in one group


def _worker(rank: int, world_size: int, blocks: list[dict], root: str) -> list:
    from tests import doc_preludes

    start = os.getcwd()
    try:
        return subtests(blocks, lambda **block: doc_preludes.run_block(Path(root), rank, **block))
    finally:
        os.chdir(start)


@pytest.mark.slow
def test_run_and_cli_blocks_execute_on_two_ranks(tmp_path):
    blocks = [dataclasses.asdict(b) for b in BLOCKS if b.kind in IN_GROUP]
    results = run_distributed(_worker, 2, timeout=300, root=str(tmp_path), blocks=blocks)
    assert len(results[0]) == len(blocks)


def test_the_unfolding_of_commands():
    block = 'ARGS="--a 1"\nsudo X=1 python s.py $ARGS \\\n  --b "c d"  # note\nfor r in 1 2; do zeroshard t $r; done\n'
    assert commands(block) == [
        ["python", "s.py", "--a", "1", "--b", "c d"],
        ["zeroshard", "t", "1"],
        ["zeroshard", "t", "2"],
    ]


def test_a_rejected_flag_fails_the_parse_check():
    with pytest.raises(AssertionError, match="rejected"):
        parse_command(["zeroshard", "bench", "--no-such-flag"])
    with pytest.raises(AssertionError, match="rejected"):
        parse_command(["torchrun", "--nproc_per_node", "2", "examples/tp_zero.py", "--tp", "two"])


def test_an_unmarked_block_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n\n```python\nx = 1\n```\n<!-- doc-test: skip why -->\n```bash\nls\n```\n")
    found = [(b.line, b.kind, b.args) for b in collect([page], root=tmp_path)]
    assert found == [(3, None, ""), (7, "skip", "why")]
