"""The Ray backend's admission: first come, first served across task shapes, in this process."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(eq=False)
class Entry:
    """One task waiting for its turn, by its shape (what it asks of Ray)."""

    shape: tuple[Any, ...]
    submitted: bool = False  # its task was handed to Ray


class Admission:
    """First come, first served across shapes: a task is submitted only when every earlier task that
    has not started yet has the same shape and was submitted already (Ray keeps one shape's queue in the
    order tasks were submitted, so tasks are handed to Ray in the order cells entered here)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: list[Entry] = []

    def enter(self, shape: tuple[Any, ...]) -> Entry:
        with self._cond:
            entry = Entry(shape)
            self._queue.append(entry)
            return entry

    def wait_turn(self, entry: Entry, stop: Callable[[], bool], deadline: float | None) -> bool:
        """True when `entry` may be submitted; False if `stop()` or the deadline came first."""
        with self._cond:
            while True:
                ahead = self._queue[: self._queue.index(entry)]
                if all(e.shape == entry.shape and e.submitted for e in ahead):
                    return True
                if stop() or (deadline is not None and time.monotonic() >= deadline):
                    return False
                self._cond.wait(0.1)

    def submitted(self, entry: Entry) -> None:
        """`entry`'s task was handed to Ray: the entries behind it may be submitted now."""
        with self._cond:
            entry.submitted = True
            self._cond.notify_all()

    def leave(self, entry: Entry) -> None:
        with self._cond:
            if entry in self._queue:
                self._queue.remove(entry)
                self._cond.notify_all()
