"""Both backends' dispatcher: a batch's cells run in input order on a fixed number of lanes (threads).

A lane takes the next cell, which takes its place in the backend's queue before the next lane can take
one (so cells queue in input order, whichever lane thread runs first), runs it to its end (waiting for
cards, attempts, retries), then takes the next. With as many lanes as the batch could ever run at
once, threads and open descriptors depend on the machine or the cluster, never on the number of cells:
a cell queued behind the lanes holds nothing, and a cancelled batch cancels its queued cells at once
instead of one by one.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from levers9.launch.backend import Batch


class CellRunner(Protocol):
    """One cell's work: `take_place()` when a lane takes it (never raises), then `run()`, which resolves `future`
    whatever happens."""

    future: Future[Any]

    def take_place(self) -> None: ...

    def run(self) -> None: ...


def dispatch(batch: Batch, runners: Sequence[CellRunner], lanes: int) -> None:
    """Start min(lanes, cells) lane threads that run `runners` in order; returns at once."""
    queue: collections.deque[CellRunner] = collections.deque(runners)
    lock = threading.Lock()

    def next_runner() -> CellRunner | None:
        with lock:
            if not queue:
                return None
            runner = queue.popleft()
            runner.take_place()  # under the lock: places are taken in input order
            return runner

    def lane() -> None:
        while (runner := next_runner()) is not None:
            runner.run()

    def cancel_queued() -> None:
        with lock:
            queued = list(queue)
        for runner in queued:
            runner.future.cancel()

    batch.cancel.on_cancel(cancel_queued)
    name = batch.label or batch.spec.name
    for index in range(max(1, min(lanes, len(runners)))):
        threading.Thread(target=lane, name=f"levers9-{name}-lane{index}", daemon=True).start()
