"""Subcommands of the `zeroshard` CLI, one module each.

A command module exposes `register(subparsers)`, which adds its parser (best through `add_command`, so
every command gets the same help layout) and calls `parser.set_defaults(func=run)`; `run(args) -> int`
does the work. `zeroshard.tools.cli.COMMAND_MODULES` lists the modules; one that is absent is simply not offered.
Import only light modules at module level and heavy ones (torch) inside `run`, so that `zeroshard --help`
and `zeroshard estimate` stay fast.
"""

from __future__ import annotations

import argparse


class CommandError(Exception):
    """A user error: the CLI prints `zeroshard <command>: error: <message>` and exits with code 2."""


def add_command(
    subparsers: argparse._SubParsersAction, name: str, *, summary: str, description: str, examples: list[str]
) -> argparse.ArgumentParser:
    """Add a subparser whose --help shows the description and an 'examples:' section."""
    epilog = "examples:\n" + "\n".join(f"  {example}" for example in examples)
    return subparsers.add_parser(
        name, help=summary, description=description, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def bounded(parse, minimum: float, *, inclusive: bool = True):
    """An argparse `type` that parses with `parse` (e.g. "7.5B", "32GiB") and enforces a lower bound,
    naming the flag's value in the error."""

    def convert(text: str):
        try:
            value = parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        if value < minimum or (not inclusive and value == minimum):
            bound = "at least" if inclusive else "greater than"
            raise argparse.ArgumentTypeError(f"must be {bound} {minimum}, got {text!r}")
        return value

    return convert


def params_from_args(args: argparse.Namespace) -> int:
    """The parameter count of `--params N` or `--model NAME_OR_JSON` (mutually exclusive flags)."""
    if args.params is not None:
        return args.params
    from zeroshard.tools import estimator as estimate

    try:
        return estimate.count_params_from_config(args.model)
    except ValueError as err:
        raise CommandError(f"--model: {err}") from None


def recipe_from_args(args: argparse.Namespace, k: int | None = None):
    """The estimator's Recipe of `--precision`, `--optimizer` and `--master` (and `k`, an override of
    K); a combination the estimator refuses (bf16 masters without bf16) is a CommandError."""
    from zeroshard.tools import estimator as estimate

    try:
        return estimate.recipe(args.precision, args.optimizer, k, args.master)
    except ValueError as err:
        raise CommandError(
            f"--precision {args.precision} --optimizer {args.optimizer} --master {args.master}: {err}"
        ) from None
