"""What `.map` returns: its results in input order or as cells complete (`Completed` pairs), and the
waits behind them, which a Ctrl-C, SIGTERM or SIGHUP to the caller always cuts short."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import queue
import sys
from collections.abc import Iterator
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from types import TracebackType
from typing import Any, Generic, TypeVar

from levers9.errors import add_note
from levers9.launch.backend import CancelToken
from levers9.launch.cells import Cell
from levers9.launch.progress import Reporter
from levers9.launch.run_folder import RunRecord
from levers9.procs.watch import WAKE_S, exit_on_terminate

R = TypeVar("R")
T = TypeVar("T")

RECORD_WAIT = 10.0  # seconds close() waits for the last results to be stored


@dataclasses.dataclass(frozen=True)
class Completed(Generic[R]):
    """One result of map(order="completed"): which input it belongs to, and its value (or, with
    return_exceptions=True, its exception). Unpacks as a pair: `for index, value in results`."""

    index: int
    value: R

    def __iter__(self) -> Iterator[Any]:
        return iter((self.index, self.value))


class MapResults(Generic[T]):
    """The results of a map, in input order or as cells complete. Closing it (or dropping it) cancels
    what has not finished. A result is let go once it was yielded: the map holds only what the caller
    has not read yet, so a sweep's memory is what the caller itself keeps."""

    def __init__(
        self,
        cells: list[Cell],
        futures: list[Future[Any]],
        cancel: CancelToken,
        return_exceptions: bool,
        order: str,
        reporter: Reporter | None,
        record: RunRecord | None,
    ) -> None:
        self._cells = cells
        self._futures: list[Future[Any] | None] = list(futures)  # None once its result was yielded
        self._cancel = cancel
        self._return_exceptions = return_exceptions
        self._reporter = reporter
        self._record = record
        self._next = 0
        self._closed = False
        self._finished: queue.SimpleQueue[int] | None = None
        if order == "completed":
            self._finished = queue.SimpleQueue()
            for index, future in enumerate(futures):
                future.add_done_callback(functools.partial(_put, self._finished, index))

    @property
    def run_id(self) -> str | None:
        """The run's folder name (for `levers9 runs show RUN`), or None for an empty map."""
        return None if self._record is None else self._record.path.name

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        if self._closed or self._next >= len(self._futures):
            self.close()
            raise StopIteration
        self._next += 1
        if self._finished is None:
            return self._value(self._next - 1)
        position = _next_finished(self._finished)
        return Completed(position, self._value(position))  # type: ignore[return-value]

    def _value(self, position: int) -> Any:
        """The result at `position`, or its exception raised (returned with return_exceptions); once it is
        done the map lets go of it."""
        future = self._futures[position]
        assert future is not None, f"result {position} was already yielded"
        try:
            return wait_done(future).result()
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)) or future.cancelled() or not future.done():
                self.close()
                raise
            cell = self._cells[position]
            if self._return_exceptions:
                return exc
            self.close()
            add_note(
                exc,
                f"levers9: cell #{cell.index} {cell.describe()} failed; the cells not yet finished were cancelled",
            )
            raise
        finally:
            if future.done():
                self._futures[position] = None
            future = None  # an exception returned or raised keeps this frame: not its future (nor so its value)

    def close(self) -> None:
        """Cancel every cell not yet finished, kill running jobs and wait until they have ended."""
        if self._closed:
            return
        self._closed = True
        self._cancel.cancel()
        try:
            # A second Ctrl-C while the jobs are being stopped is the caller's: it propagates (the
            # jobs are already cancelled and die with their lifeline), only the waiting is cut short.
            for future in self._futures:
                if future is None:  # yielded, so done
                    continue
                with contextlib.suppress(Exception):  # its outcome is not ours to raise here
                    wait_done(future).exception()  # a cancelled future that never ran counts as done at once
            if self._record is not None:
                # Futures wake their waiters before running done-callbacks: wait for the callback that
                # closes the record (it runs after every result was stored), so a resume right after
                # this sweep finds them all.
                self._record.closed.wait(RECORD_WAIT)
        finally:
            if self._reporter is not None:
                self._reporter.close()
            if self._record is not None:
                self._record.close()

    def __enter__(self) -> MapResults[T]:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            if sys.is_finalizing():  # the lanes no longer run: waiting on them would hang the exit; the jobs
                self._cancel.cancel()  # end with the caller's lifeline
                return
            with contextlib.suppress(Exception):
                self.close()

    def __len__(self) -> int:
        return len(self._futures)


def _put(target: queue.SimpleQueue[int], index: int, _future: Future[Any]) -> None:
    target.put(index)


def wait_done(future: Future[R]) -> Future[R]:
    """`future`, once it is done (or cancelled), waited for in WAKE_S steps (levers9.procs.watch: a Ctrl-C
    another thread got still ends the wait); SIGTERM or SIGHUP to this process meanwhile raises SystemExit,
    which cancels the sweep as Ctrl-C does (see exit_on_terminate)."""
    if not future.done():  # a finished cell's result costs no signal-handler changes
        with exit_on_terminate():
            while not future.done():
                wait_futures([future], timeout=WAKE_S)
    return future


def _next_finished(finished: queue.SimpleQueue[int]) -> int:
    """The next index a done-callback put in `finished`, waited for in WAKE_S steps (SIGTERM as in wait_done)."""
    with exit_on_terminate():
        while True:
            try:
                return finished.get(timeout=WAKE_S)
            except queue.Empty:
                continue
