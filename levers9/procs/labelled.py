"""Several children's output on the caller's streams, each line labelled, pieces of long lines kept together."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable

from levers9.procs import echo


class LabelledOutput:
    """Text from several sources (ranks, cells) to the caller's streams (`write`): each `label` ("[rank 1] ") at the
    start of each line of its source, and after each "\\r" that redraws one. Text is a line with its "\\n", or a
    piece of a long one without: a line another source left unfinished on that stream is ended first, so no
    source's text is written into another's line. Safe to call from several threads."""

    def __init__(self, write: Callable[[str, str], None] = echo.write, *, redraws: bool = True) -> None:
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
