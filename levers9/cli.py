"""The `levers9` command. Each subcommand lives in its own module, which provides `register(subparsers)`."""

from __future__ import annotations

import argparse
import importlib
import sys

from levers9 import __version__
from levers9.console_log import console_handler

# Modules that each add one subcommand (and its options) to the parser.
COMMAND_MODULES: tuple[str, ...] = (
    "levers9.launch.workspace_cli",
    "levers9.doctor",
    "levers9.stacks_cli",
    "levers9.launch.ray_cli",
    "levers9.launch.runs_cli",
    "levers9.run_cli",
)


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser, with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="levers9", description="Train on 1, 2, 4 or 8 cards.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    parser.add_argument("--version", action="version", version=f"levers9 {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help(sys.stderr)
        return 2
    with console_handler(args.verbose):  # the `levers9` logger only: a script's root logger stays its own
        status: int = args.handler(args)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
