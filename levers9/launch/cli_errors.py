"""How the job layer's subcommands (`levers9 runs`, `workspace`, `ray`) end on a levers9 error: the
error's own words (what was seen, what was expected, the fix) as one line on stderr, never a traceback."""

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
