"""`zeroshard` command line: a thin dispatcher over the command modules in `COMMAND_MODULES`.

To add a subcommand, write `zeroshard/tools/commands/<name>.py` with `register(subparsers)` and `run(args)`
(see `zeroshard.tools.commands`) and append its module name here. Modules not present are skipped, so the
list may name commands that are still being written.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys
from collections.abc import Sequence

from zeroshard.tools.commands import CommandError

logger = logging.getLogger(__name__)

COMMAND_MODULES = [
    "zeroshard.tools.commands.estimate",
    "zeroshard.tools.commands.train",
    "zeroshard.tools.commands.bench",
    "zeroshard.tools.commands.consolidate",
    "zeroshard.tools.commands.convert",
    "zeroshard.tools.commands.advise",
    "zeroshard.tools.commands.generate",
]

EXAMPLES = """examples:
  zeroshard train                                   # the demo: a small GPT, 2 ranks, stage 3
  zeroshard estimate --params 7.5e9 --ranks 64      # the paper's Figure 1 for your model
  zeroshard bench --ranks 2 --peers                 # stages 0-3 (and torch/DeepSpeed) side by side
  zeroshard advise --params 7.5e9 --ranks 64 --memory 32GB --bandwidth 25GB
  zeroshard consolidate ckpt model.safetensors      # sharded checkpoint -> one file
  zeroshard generate ./model --prompt "Hello"       # a model larger than memory (ZeRO-Inference)
  zeroshard COMMAND --help
"""


def _present_modules(names: Sequence[str]) -> list:
    modules = []
    for name in names:
        try:
            if importlib.util.find_spec(name) is None:
                continue  # not written (yet): not offered
            modules.append(importlib.import_module(name))
        except Exception as err:  # noqa: BLE001 - a broken command must not take the others down with it
            logger.warning("command module %s could not be loaded: %s", name, err)
    return modules


def build_parser(module_names: Sequence[str] = COMMAND_MODULES) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zeroshard",
        description="ZeRO (Zero Redundancy Optimizer) stages 0-3 for PyTorch.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logging")
    subparsers = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    for module in _present_modules(module_names):
        module.register(subparsers)
    return parser


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("zeroshard")
    except Exception:  # noqa: BLE001 - running from a source tree that was never installed
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `zeroshard` console script; returns the exit code (2 for user errors)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse already printed usage/--help; hand its code back
        return int(exit_.code or 0)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except (CommandError, ValueError, OSError) as err:
        if args.debug:
            raise
        print(f"zeroshard {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
