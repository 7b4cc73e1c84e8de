"""Where levers9's own messages go: the `levers9` logger only, never the root logger.

The command line gives that logger a handler of its own (`levers9: message` on stderr) and stops it
propagating, so the root logger stays unconfigured, as a script expects it (its own
`logging.basicConfig` works, and libraries' INFO lines stay quiet, as under torchrun). A script's
ranks, forked from the command line, take that handler back before the script starts
(`forget_console_handler`), so they begin with the logging state of a fresh interpreter.
"""

from __future__ import annotations

import logging
import sys

LOGGER = "levers9"


class _ConsoleHandler(logging.StreamHandler):  # type: ignore[type-arg,unused-ignore]
    """The command line's handler on the `levers9` logger (a class of its own, so it can be found and removed)."""


def install_console_handler(verbose: bool) -> None:
    """levers9's messages at INFO (DEBUG with `verbose`) on stderr as `levers9: message`; the root logger untouched."""
    logger = logging.getLogger(LOGGER)
    handler = _ConsoleHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("levers9: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)
    logger.propagate = False


def forget_console_handler() -> None:
    """Undo install_console_handler in this process (a script's rank): the `levers9` logger as Python made it."""
    logger = logging.getLogger(LOGGER)
    found = [h for h in logger.handlers if isinstance(h, _ConsoleHandler)]
    if not found:
        return
    for handler in found:
        logger.removeHandler(handler)
    logger.setLevel(logging.NOTSET)
    logger.propagate = True
