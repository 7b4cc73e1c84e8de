"""A batch's run folder, made once and written while the batch runs (the layout: run_reader.py).

`RunRecord` makes the folder (`RunFolder.make`) and writes its run.json, events.jsonl and results/;
the `RunFolder` value it made, the folder's path and its loss record, travels with the Batch to the
backend, which writes each attempt's logs and meta.json there. While a batch runs, its cells' keys
(cell_keys.py) are claimed (claims.py): a resume waits for a live run that claims any of its cells,
then reuses what it stored.

A run folder appears whole: made as .new-<pid>-<run id> with its run.json, then renamed, after
retention (run_retention.py) made room. On a full disk the sweep still runs: unrecorded (said in one
line at its start), or with what could not be kept said in one warning at its end (the folder's
state_files.Losses).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import cloudpickle

from levers9 import state_files
from levers9.errors import PrivateDirError
from levers9.launch import claims
from levers9.launch.cell_keys import cell_key, function_key
from levers9.launch.cells import Cell
from levers9.launch.run_reader import EVENTS_FILE, FORMAT, NEW_PREFIX, RESULTS, RUN_FILE, stored_results
from levers9.launch.run_retention import clean, keep_runs
from levers9.launch.settings import runs_dir
from levers9.private_dir import private_dir
from levers9.state_files import Losses, write_atomic

log = logging.getLogger("levers9.launch")

STATE_FIX = (
    "set LEVERS9_STATE_DIR to a folder of your own that you can write (e.g. export LEVERS9_STATE_DIR="
    "~/.levers9-state), or XDG_CACHE_HOME to a cache folder you can write"
)
RESERVE = 512  # spaces after run.json's first text: room to write its end in place on a full disk


def runs_root() -> Path:
    """runs_dir(), created private (0700) if missing; PrivateDirError naming LEVERS9_STATE_DIR and
    XDG_CACHE_HOME if it cannot be (a HOME that is not writable); OSError on a full disk."""
    return private_dir(runs_dir(), fix=STATE_FIX)


@dataclasses.dataclass(frozen=True)
class RunFolder:
    """One batch's run folder: where it is, and what a full disk cost it (its loss record, said in one
    warning when the batch's record closes). Made once, by the batch's RunRecord; the Batch carries it."""

    path: Path
    losses: Losses

    @classmethod
    def make(cls, run_id: str, record: dict[str, Any]) -> RunFolder:
        """runs_dir()/run_id holding `record` as its run.json (and an empty results/), retention applied
        first. The folder appears whole (made under a hidden name, then renamed), so another caller's
        retention never sees it without the record that names its living caller. An OSError (the disk
        is full) leaves nothing behind: the run goes unrecorded, said now in one line. PrivateDirError
        if the state folder is not a private folder of ours."""
        path = Path(os.path.abspath(os.path.expanduser(runs_dir()))) / run_id
        folder = cls(path, Losses(path))
        try:
            root = runs_root()
            clean(keep=keep_runs() - 1)
            making = root / f"{NEW_PREFIX}{os.getpid()}-{run_id}"
            try:
                os.mkdir(making, 0o700)
                write_atomic(making / RUN_FILE, json.dumps(record, indent=1).encode(), pad=RESERVE)
                os.mkdir(making / RESULTS, 0o700)
                os.rename(making, root / run_id)
            except BaseException:
                shutil.rmtree(making, ignore_errors=True)
                raise
        except OSError as exc:
            if isinstance(exc, PrivateDirError):
                raise
            folder.losses.unrecorded_run(runs_dir(), run_id, exc)
        return folder


class RunRecord:
    """Makes one batch's run folder (`folder`) and writes its run.json, events.jsonl and results/ (an
    Events, plus result storage).

    A write that fails (a full disk) never reaches the cells: if the folder cannot be made the run goes
    unrecorded, said in one line at its start; else what could not be kept is said in one warning
    when it closes (state_files.Losses)."""

    def __init__(
        self, run_id: str, *, name: str, backend: str, func: Callable[..., Any], cells: Sequence[Cell]
    ) -> None:
        self.fn_key = function_key(func)
        self.keys = {cell.index: cell_key(self.fn_key, cell) for cell in cells}
        self._meta: dict[str, Any] = {
            "format": FORMAT,
            "id": run_id,
            "name": name,
            "backend": backend,
            "function": f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', '?')}",
            "fn_key": self.fn_key,
            "pid": os.getpid(),
            "started": time.time(),
            "total": len(cells),
            "cells": {str(cell.index): cell.describe() for cell in cells},
        }
        self._lock = threading.Lock()
        self._claim = claims.Claim(None, None)
        self.closed = threading.Event()  # set once run.json has its end (and every result was stored)
        self.done = 0
        self.failed = 0
        self.reused = 0
        self.folder = RunFolder.make(run_id, self._meta)
        self.path, self.losses = self.folder.path, self.folder.losses
        self._events = state_files.AppendLog(
            self.path / EVENTS_FILE, lambda _path, _n, exc: self.losses.lost("events.jsonl line", exc)
        )

    def _event(self, cell: Cell, state: str, **extra: Any) -> None:
        line = json.dumps({"i": cell.index, "state": state, "t": round(time.time(), 3), **extra})
        with self._lock:
            if not self.closed.is_set():
                self._events.write(line.encode() + b"\n")

    def waiting(self, cell: Cell, why: str) -> None:
        pass  # the record keeps when cells ran and ended; why one waits matters while it waits

    def started(self, cell: Cell, cards: str, attempt: int) -> None:
        self._event(cell, "running", card=cards, attempt=attempt)

    def retrying(self, cell: Cell, attempt: int, reason: str) -> None:
        self._event(cell, "retrying", attempt=attempt, reason=reason)

    def finished(self, cell: Cell, ok: bool, error: BaseException | None = None) -> None:
        with self._lock:
            self.done += ok
            self.failed += not ok
        extra = {} if ok or error is None else {"error": describe_error(error)}
        self._event(cell, "done" if ok else "failed", **extra)

    def output(self, cell: Cell, stream: str, text: str) -> None:
        pass

    def store(self, cell: Cell, future: Future[Any]) -> None:
        """Keep the value of a cell that succeeded (a done-callback; never raises)."""
        if future.cancelled() or future.exception() is not None:
            return
        try:
            blob = cloudpickle.dumps(future.result())
        except Exception as exc:
            log.debug("%s: result not kept for resume (%s)", self.path.name, exc)
            return
        try:
            write_atomic(self.path / RESULTS / f"{self.keys[cell.index]}.pkl", blob)
        except OSError as exc:
            self.losses.lost_result(cell.index, exc)

    def claim(self, *, wait: bool) -> None:
        """Claim this batch's cells until the record closes; with `wait` (resume), first wait while another
        live run claims any of them, so that what it computes is reused here, not computed twice."""
        if self.losses.unrecorded:
            return
        name = f"{self._meta['name']} (run {self.path.name})"
        keys = sorted(set(self.keys.values()))
        self._claim = claims.claim(runs_dir().parent / "claims", self.path.name, keys, wait=wait, what=name)

    def reuse(self, cells: Sequence[Cell]) -> dict[int, Any]:
        """Values of `cells` that a kept run with this function already computed, by cell index; each
        reused result is linked into this run too, so this run alone holds every result it returns."""
        found = stored_results(self.fn_key, exclude=self.path.name)
        values: dict[int, Any] = {}
        for cell in cells:
            source = found.get(self.keys[cell.index])
            if source is None:
                continue
            try:
                values[cell.index] = cloudpickle.loads(state_files.read_private(source))
            except Exception as exc:
                log.warning("not reusing %s (%s: %s); running that cell again", source, type(exc).__name__, exc)
                continue
            target = self.path / RESULTS / source.name
            try:
                os.link(source, target)
            except OSError:
                try:
                    write_atomic(target, state_files.read_private(source))
                except OSError as exc:
                    self.losses.lost_result(cell.index, exc)
            self._event(cell, "done", reused=True)
        self.reused = len(values)
        self.done += len(values)
        return values

    def close(self) -> None:
        """Write the end time and counts into run.json, close the events file and say what could not be
        kept, if anything (idempotent). On a full disk the end is written into run.json's own space."""
        with self._lock:
            if self.closed.is_set():
                return
            self._events.close()
            self._meta.update(ended=time.time(), done=self.done, failed=self.failed, reused=self.reused)
            if self.losses.error is not None:
                self._meta["incomplete"] = True  # a full disk cost some of it: cells() does not guess
            if not self.losses.unrecorded:
                blob = json.dumps(self._meta, indent=1).encode()
                try:
                    write_atomic(self.path / RUN_FILE, blob)
                except FileNotFoundError:
                    pass  # the folder was removed (runs clean while it ran)
                except OSError as exc:
                    if not state_files.overwrite_in_place(self.path / RUN_FILE, blob):
                        self.losses.lost_end(exc)
            self.losses.report()
            self._claim.release()
            self.closed.set()

    def close_when_done(self, futures: Sequence[Future[Any]]) -> None:
        """Close once every one of `futures` (the batch's) is resolved, whoever consumes them, or nobody."""
        left = [len(futures)]
        lock = threading.Lock()

        def one_done(_future: Future[Any]) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self.close()

        for future in futures:
            future.add_done_callback(one_done)

    def discard(self) -> None:
        """Close and remove the run folder: the batch was refused before anything ran."""
        self.close()
        shutil.rmtree(self.path, ignore_errors=True)


def describe_error(error: BaseException) -> str:
    """'ValueError: boom' (first line of the message only)."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


