"""The `levers9` command. Each subcommand lives in its own module, which provides `register(subparsers)`."""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import os
import sys
from collections.abc import Callable

from levers9 import __version__
from levers9.console_log import console_handler
from levers9.errors import Levers9Error

# The module that adds each subcommand (and its options) to the parser, by the subcommand's name.
COMMAND_MODULES: dict[str, str] = {
    "workspace": "levers9.cli.workspace",
    "doctor": "levers9.cli.doctor",
    "stacks": "levers9.cli.stacks",
    "ray": "levers9.launch.ray.resources",
    "runs": "levers9.cli.runs",
    "run": "levers9.cli.run",
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser for `argv`: with only the subcommand it names registered when it names one (so
    `levers9 run` imports what `run` needs, not what `doctor` or `workspace` do, before its ranks start),
    else with every subcommand (top-level help, an unknown command's error listing them all)."""
    parser = argparse.ArgumentParser(prog="levers9", description="Train on 1, 2, 4 or 8 cards.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    parser.add_argument("--version", action="version", version=f"levers9 {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = named_command(sys.argv[1:] if argv is None else argv)
    for command, module in COMMAND_MODULES.items():
        if chosen in (None, command):
            importlib.import_module(module).register(sub)
    return parser


def named_command(argv: list[str]) -> str | None:
    """The subcommand `argv` names (its first word that is not an option: the top-level options take no
    value), or None when it names none of them or asks for the top-level help first."""
    for word in argv:
        if word in ("-h", "--help"):
            return None
        if not word.startswith("-"):
            return word if word in COMMAND_MODULES else None
    return None


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help(sys.stderr)
        return 2
    with console_handler(args.verbose):  # the `levers9` logger only: a script's root logger stays its own
        try:
            status: int = args.handler(args)
        finally:
            _let_go_of_a_gone_stdout()
    return status


def _let_go_of_a_gone_stdout() -> None:
    """Flush sys.stdout now; where its reader has gone (`levers9 run train.py | head`, said once already), point it
    at /dev/null, so that the interpreter's own flush at exit does not fail again on bytes still buffered and make
    the exit status 120 (seen on Python 3.14; the recipe is the one in the `signal` module's "Note on SIGPIPE")."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
    except Exception:  # noqa: BLE001 - None, closed or not a stream: the interpreter's exit says nothing of those either
        pass


# How the job layer's subcommands (`levers9 runs`, `workspace`, `ray`) answer bad input: a levers9 error in
# its own words (what was seen, what was expected, the fix) as one line on stderr, never a traceback, and a
# bad whole-number argument in argparse's usage error.


Handler = Callable[[argparse.Namespace], int]


def said_as(prefix: str, status: int) -> Callable[[Handler], Handler]:
    """A handler that prints a Levers9Error it raises as '<prefix>: <the error>' and returns `status`."""

    def wrap(handler: Handler) -> Handler:
        @functools.wraps(handler)
        def run(args: argparse.Namespace) -> int:
            try:
                return handler(args)
            except Levers9Error as exc:
                print(f"{prefix}: {exc}", file=sys.stderr)
                return status

        return run

    return wrap


def whole_number(unit: str, low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse `type=` taking a whole number of `unit` from `low` to `high` (no upper bound when None)."""
    expected = f"{low} to {high} {unit}" if high is not None else f"a whole number of {unit} ({low} or more)"

    def parse(text: str) -> int:
        try:
            value: int | None = int(text)
        except ValueError:
            value = None  # not a whole number
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
        return value

    return parse
