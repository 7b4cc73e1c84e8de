"""Where levers9's own messages go: the `levers9` logger only, never the root logger.

The command line gives that logger a handler of its own (`levers9: message` on stderr) and stops it
propagating, so the root logger stays unconfigured, as a script expects it (its own `logging.basicConfig`
works, and libraries' INFO lines stay quiet, as under torchrun). A script's ranks are forked from their caller
(the command line, or a program calling run_script); before the script starts they take that handler back and
empty the root logger (`fresh_logging`), so the script begins with the root logger of a fresh interpreter, as
a torchrun worker does.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

LOGGER = "levers9"


class _ConsoleHandler(logging.StreamHandler):  # type: ignore[type-arg,unused-ignore]
    """The command line's handler on the `levers9` logger (a class of its own, so it can be found and removed)."""


class _Prefixed(logging.Formatter):
    """`levers9: message`, or the message alone where it names its command already (`levers9 run: ...`)."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if text.startswith("levers9 ") else f"levers9: {text}"


@contextlib.contextmanager
def console_handler(verbose: bool) -> Iterator[None]:
    """While the command runs: levers9's messages at INFO (DEBUG with `verbose`) on stderr as `levers9: message`,
    the root logger untouched. Afterwards the `levers9` logger is as it was (a program or a test that calls
    `levers9.cli.main` in-process keeps no handler on a stream that may since have closed)."""
    logger = logging.getLogger(LOGGER)
    level, propagate = logger.level, logger.propagate
    handler = _ConsoleHandler(sys.stderr)
    handler.setFormatter(_Prefixed("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def fresh_logging() -> None:
    """In a script's rank, before the script: the `levers9` logger and the root logger as a fresh interpreter has
    them (no handlers, root at WARNING). Only this process changes; the caller's handlers stay the caller's."""
    logger = logging.getLogger(LOGGER)
    found = [h for h in logger.handlers if isinstance(h, _ConsoleHandler)]
    for handler in found:
        logger.removeHandler(handler)
    if found:
        logger.setLevel(logging.NOTSET)
        logger.propagate = True
    root = logging.getLogger()
    for other in list(root.handlers):
        root.removeHandler(other)
    root.setLevel(logging.WARNING)
