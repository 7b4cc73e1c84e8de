"""Parent side: children's output onto the caller's own streams, looked up at each write (a caller may replace
sys.stdout at any time).

The bytes a child wrote reach the caller's stream unchanged where it has a binary buffer (text decoded with
surrogateescape encodes back to the same bytes); a stream without one gets the text, with any undecodable byte
replaced. A stream that is None (`python sweep.py >&-`), has no `flush`, or raises costs only the output: a
child's value and failure never depend on the caller's stdout, as `print`'s never do on a healthy one. The
first write a stream refuses is said once on levers9's logger.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Callable, Hashable
from typing import Any

log = logging.getLogger("levers9")
_refused: set[str] = set()  # streams whose refusal was said already


def stream(name: str) -> Any:
    """sys.stdout or sys.stderr as they are now ("stdout" or "stderr")."""
    return sys.stdout if name == "stdout" else sys.stderr


def isatty(out: Any) -> bool:
    """True if `out` is a terminal (False for None, a closed stream, or one without isatty)."""
    try:
        return bool(out.isatty())
    except Exception:
        return False


def write(name: str, text: str) -> None:
    """Write `text` to the caller's sys.stdout or sys.stderr (`name`) and flush it; never raises."""
    out = stream(name)
    if out is None:
        return
    try:
        buffer = getattr(out, "buffer", None)
        if buffer is not None and hasattr(buffer, "write"):
            _flush(out)  # what the caller wrote through the text layer goes first
            buffer.write(text.encode("utf-8", "surrogateescape"))  # children's bytes were decoded as UTF-8
            _flush(buffer)
        else:
            out.write(printable(text))
            _flush(out)
    except Exception as exc:  # noqa: BLE001 - the caller's stream decides nothing about the run
        if name not in _refused:
            _refused.add(name)
            with contextlib.suppress(Exception):
                log.warning("%s", refused(name, exc))  # the command line's handler puts "levers9: " before it


def refused(name: str, exc: Exception) -> str:
    """What to say when sys.stdout or sys.stderr (`name`) refused children's output with `exc`: a pipe whose reader
    is gone (`| head`), a closed stream, or an object that is not a writable stream."""
    seen = f"sys.{name} refused children's output ({type(exc).__name__}: {exc}); their output to it is dropped, their results are not."
    kept = "A job's output is also kept: `levers9 runs logs RUN CELL`."
    if isinstance(exc, BrokenPipeError):
        return (f"{seen} It is a pipe whose reader has gone (`| head` ends after its lines). Expected a reader until the "
                f"run ends; to keep all of the output, send it to a file (`> out.log`) or read it all (`| tee out.log`). "
                f"{kept}")  # fmt: skip
    if isinstance(exc, ValueError) and "closed file" in str(exc):
        return f"{seen} The stream was closed. Expected sys.{name} open until the run ends; close it afterwards. {kept}"
    return f"{seen} Expected a stream with write() (and flush()); to see the output, give sys.{name} one. {kept}"


def printable(text: str) -> str:
    """`text` with the surrogates that stand for undecodable bytes replaced by U+FFFD."""
    if text.isascii():
        return text
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _flush(out: Any) -> None:
    flush = getattr(out, "flush", None)
    if flush is not None:
        flush()


class LabelledOutput:
    """Text from several sources (ranks, cells) to the caller's streams (`write`): each `label` ("[rank 1] ") at the
    start of each line of its source, and after each "\\r" that redraws one. Text is a line with its "\\n", or a
    piece of a long one without: a line another source left unfinished on that stream is ended first, so no
    source's text is written into another's line. Safe to call from several threads."""

    def __init__(self, write: Callable[[str, str], None] = write, *, redraws: bool = True) -> None:
        self.write, self.redraws = write, redraws  # redraws=False: a "\r" is written as it is, with no label after it
        self._lock = threading.Lock()
        self._mid_line: dict[str, Hashable] = {}  # caller's stream -> the source whose last piece there ended mid-line
        self._redrawn: set[tuple[Hashable, str]] = set()  # (source, stream) whose last piece ended in a "\r"

    def __call__(self, source: Hashable, label: str, stream: str, text: str) -> None:
        key = (source, stream)
        with self._lock:
            mid_line = self._mid_line.get(stream)
            head = "\n" if mid_line is not None and mid_line != source else ""
            if mid_line != source or (key in self._redrawn and not text.startswith("\n")):
                head += label  # a new line, or the redraw its last piece's "\r" began
            self._redrawn.discard(key)
            if self.redraws and label and "\r" in text:
                text = _redraws_labelled(text, label)
                if text.endswith("\r"):
                    self._redrawn.add(key)
            if text.endswith("\n"):
                self._mid_line.pop(stream, None)
            else:
                self._mid_line[stream] = source
            self.write(stream, head + text)


def _redraws_labelled(text: str, label: str) -> str:
    """`text` with `label` after every "\\r" that starts a redrawn line (not one that ends a line, "\\r\\n")."""
    parts = text.split("\r")
    return parts[0] + "".join("\r" + ("" if part.startswith("\n") or not part else label) + part for part in parts[1:])
