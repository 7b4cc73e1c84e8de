"""What the caller sees while a batch runs: each job's output with its cell as prefix, and on a
terminal a one-line progress display for a sweep.

Job output goes to the caller's sys.stdout / sys.stderr (the stream the job wrote to), as
`[train #3] line`. The progress line is drawn on stderr only when stderr is a terminal and the batch
has more than one cell; output lines clear it and it is redrawn below them.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

from levers9.launch.backend import Batch
from levers9.launch.cells import Cell


class Reporter:
    """The Events of one batch: streams output with a prefix and keeps the progress line current."""

    def __init__(self, batch_label: str, total: int, *, show_progress: bool | None = None) -> None:
        self.batch: Batch | None = None
        self.label = batch_label
        self.total = total
        self._running: set[int] = set()
        self.done = 0
        self.failed = 0
        self.start = time.monotonic()
        self._lock = threading.Lock()
        self._drawn = False
        if show_progress is None:
            show_progress = total > 1 and _isatty(sys.stderr)
        self.show = show_progress

    @property
    def running(self) -> int:
        """Cells started and not yet finished (a retried cell counts once)."""
        return len(self._running)

    def started(self, cell: Cell, cards: str, attempt: int) -> None:
        with self._lock:
            self._running.add(cell.index)
            self._draw()

    def finished(self, cell: Cell, ok: bool) -> None:
        with self._lock:
            self._running.discard(cell.index)
            self.done += 1
            self.failed += 0 if ok else 1
            self._draw()

    def output(self, cell: Cell, stream: str, line: str) -> None:
        prefix = self.batch.cell_label(cell) if self.batch is not None else f"{self.label} #{cell.index}"
        target = sys.stderr if stream == "stderr" else sys.stdout
        with self._lock:
            self._clear()
            try:
                target.write(f"[{prefix}] {line}\n")
                target.flush()
            except (OSError, ValueError):
                pass
            self._draw()

    def close(self) -> None:
        """Leave the final state of the progress line on the terminal."""
        with self._lock:
            if self._drawn:
                self._draw()
                _write(sys.stderr, "\n")
                self._drawn = False
            self.show = False

    def _draw(self) -> None:
        if not self.show:
            return
        waiting = self.total - self.done - self.running
        text = (
            f"{self.label}: {self.done - self.failed}/{self.total} done, {self.running} running, "
            f"{waiting} waiting, {self.failed} failed  [{time.monotonic() - self.start:.0f}s]"
        )
        _write(sys.stderr, "\r\x1b[K" + text)
        self._drawn = True

    def _clear(self) -> None:
        if self._drawn:
            _write(sys.stderr, "\r\x1b[K")
            self._drawn = False


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _write(stream: TextIO, text: str) -> None:
    try:
        stream.write(text)
        stream.flush()
    except (OSError, ValueError):
        pass
