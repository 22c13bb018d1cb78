"""MkDocs hooks of the user guide (mkdocs.yml, `hooks:`): pages made from the sources at build time.

- `index.md` is README.md, its `docs/` link prefixes removed: the README stays the one first page, on
  the forge and on the site alike, and the strict build checks its links and anchors.
- `changelog.md` is CHANGELOG.md.
- `cli.md` is every `zeroshard` command's `--help`, read from the parser the CLI builds.
- `config_reference.md` is committed (a forge shows it too); the build fails when it differs from
  what `python -m zeroshard.tools.config_reference` writes, so the page cannot go stale.

Nothing here is written into docs/: the generated pages live in the build only.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.zeroshard")
ROOT = Path(__file__).resolve().parents[1]


def on_config(config: Any) -> Any:
    # Read this checkout's package, whichever zeroshard the environment has installed.
    src = str(ROOT / "src")
    if src not in sys.path:
        sys.path.insert(0, src)
    return config


def on_files(files: Files, config: Any) -> Files:
    files.append(File.generated(config, "index.md", content=readme_as_index()))
    files.append(File.generated(config, "changelog.md", content=(ROOT / "CHANGELOG.md").read_text(encoding="utf-8")))
    files.append(File.generated(config, "cli.md", content=cli_reference()))
    check_config_reference()
    return files


def readme_as_index() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return re.sub(r"\]\(docs/", "](", text)


def cli_reference() -> str:
    """Markdown with the `--help` of `zeroshard` and of each of its commands."""
    from zeroshard.tools.cli import build_parser

    os.environ["COLUMNS"] = "100"  # argparse wraps help at the terminal's width; fix it for the page
    parser = build_parser()
    out = io.StringIO()
    out.write("# Command line\n\n")
    out.write(
        "`zeroshard` is installed with the package. Each command's `--help`, as the installed version prints it:\n\n"
    )
    out.write(f"```\n{parser.format_help()}```\n")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.write(f"\n## zeroshard {name}\n\n```\n{sub.format_help()}```\n")
    out.write("\n## From Python\n\n::: zeroshard.tools.cli.main\n\n::: zeroshard.tools.commands.CommandError\n")
    return out.getvalue()


def check_config_reference() -> None:
    from zeroshard.tools.config_reference import render

    committed = (ROOT / "docs" / "config_reference.md").read_text(encoding="utf-8")
    if committed != render():
        log.warning(
            "docs/config_reference.md differs from the schema; regenerate it with "
            "`python -m zeroshard.tools.config_reference > docs/config_reference.md`"
        )
