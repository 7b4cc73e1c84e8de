"""How the job layer's subcommands (`levers9 runs`, `workspace`, `ray`) answer bad input: a levers9 error in
its own words (what was seen, what was expected, the fix) as one line on stderr, never a traceback, and a
bad whole-number argument in argparse's usage error."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable

from levers9.errors import Levers9Error

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
