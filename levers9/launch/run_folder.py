"""A batch's run folder, made once and written while the batch runs (the layout: run_reader.py); the
claims on its cells; and retention of old run folders.

`RunRecord` makes the folder and writes its run.json, events.jsonl and results/; the `RunFolder` it made
travels with the Batch to the backend, which writes each attempt's logs and meta.json there. On a full
disk the sweep still runs: unrecorded (said in one line at its start), or with what could not be kept
said in one warning at its end (the folder's state_files.Losses).
"""

from __future__ import annotations

import contextlib
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
from levers9.errors import ConfigError, PrivateDirError, first_line
from levers9.launch.cells import Cell, cell_key, function_key
from levers9.launch.run_reader import (
    EVENTS_FILE,
    FORMAT,
    NEW_PREFIX,
    RESULTS,
    RUN_FILE,
    Run,
    each_run_folder,
    mtime,
    stored_results,
)
from levers9.launch.settings import runs_dir
from levers9.private_dir import private_dir
from levers9.procs import fds
from levers9.procs.watch import pid_alive
from levers9.state_files import Losses, held, hold_new, lock_now, read_private, write_atomic

log = logging.getLogger("levers9.launch")

STATE_FIX = (
    "set LEVERS9_STATE_DIR to a folder of your own that you can write (e.g. export LEVERS9_STATE_DIR="
    "~/.levers9-state), or XDG_CACHE_HOME to a cache folder you can write"
)
RESERVE = 512  # spaces after run.json's first text: room to write its end in place on a full disk


@dataclasses.dataclass(frozen=True)
class RunFolder:
    """One batch's run folder: where it is, and what a full disk cost it (said when the record closes)."""

    path: Path
    losses: Losses

    @classmethod
    def make(cls, run_id: str, record: dict[str, Any]) -> RunFolder:
        """runs_dir()/run_id holding `record` as its run.json (and an empty results/), retention applied
        first. It appears whole (made under a hidden name, then renamed), so another caller's retention
        never sees it without the record that names its living caller. An OSError (a full disk) leaves
        nothing behind: the run goes unrecorded. PrivateDirError if the state folder is not ours."""
        path = Path(os.path.abspath(os.path.expanduser(runs_dir()))) / run_id
        folder = cls(path, Losses(path))
        try:
            root = private_dir(runs_dir(), fix=STATE_FIX)
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
    """One batch's record (an Events, plus result storage): a write that fails never reaches the cells."""

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
        self._claim = Claim(None, None)
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
        self._claim = claim(runs_dir().parent / "claims", self.path.name, keys, wait=wait, what=name)

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
    text = first_line(str(error))
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


# Which cells a caller is running now, so that two resumes of one sweep run each unfinished cell once.
#
#     <runs_dir>/../claims/mutex           held (LOCK_EX) while a caller checks the claims and adds its own
#     <runs_dir>/../claims/<run id>.claim  "<run id> <pid>", then the keys of its cells, one a line;
#                                          locked by its run from before its cells start until its record closes
#
# A batch with resume=True first waits while a live run (its claim file still locked) claims any of its
# keys, then takes its claim, and only then looks for stored results. A claim whose lock can be taken
# belongs to a caller that died, and is removed. A state folder where claims cannot be made claims
# nothing: resume could not find results there either.

_SUFFIX = ".claim"


class Claim:
    """One batch's claim on its cells' keys; `release()` (idempotent) lets waiting resumes go on."""

    def __init__(self, fd: int | None, path: Path | None) -> None:
        self.fd = fd
        self.path = path

    def release(self) -> None:
        if self.fd is None or self.path is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        fds.close(self.fd)
        self.fd = None


def claim(folder: Path, run_id: str, keys: Sequence[str], *, wait: bool, what: str) -> Claim:
    """Claim `keys` for run `run_id` in claims folder `folder`. With `wait`, first wait (saying so once,
    naming the run) while another live run claims any of them. Never raises for the state folder:
    a claim that cannot be written is no claim (Claim(None, None))."""
    wanted = set(keys)
    said = False
    while True:
        try:
            with held(private_dir(folder) / "mutex"):
                busy = _live_claims(folder, wanted, run_id) if wait else {}
                if not busy:
                    return _write(folder, run_id, keys)
        except OSError as exc:
            log.debug("cells of run %s not claimed (%s)", run_id, exc)
            return Claim(None, None)
        if not said:
            said = True
            names = ", ".join(f"{other} (pid {pid}, {n} of these cells)" for other, (pid, n) in busy.items())
            log.warning(
                "%s: run %s is running some of these cells now; waiting for it to end, then reusing its results "
                "(press Ctrl-C to stop waiting; `levers9 runs show %s` shows its progress).",
                what, names, next(iter(busy)),
            )
        time.sleep(0.2)


def _live_claims(folder: Path, wanted: set[str], run_id: str) -> dict[str, tuple[str, int]]:
    """Runs other than `run_id` whose live claim holds any of `wanted`: run id -> (pid, how many);
    claims of callers that died are removed."""
    busy: dict[str, tuple[str, int]] = {}
    for entry in os.scandir(folder):
        if not entry.name.endswith(_SUFFIX) or entry.name == f"{run_id}{_SUFFIX}":
            continue
        try:
            fd = fds.open_fd(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if lock_now(fd, shared=True):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)  # its caller died holding it
                continue
            with contextlib.suppress(OSError, UnicodeDecodeError):
                head, *lines = read_private(Path(entry.path)).decode().splitlines()
                other, _, pid = head.partition(" ")
                overlap = len(wanted.intersection(lines))
                if overlap:
                    busy[other] = (pid, overlap)
        finally:
            fds.close(fd)
    return busy


def _write(folder: Path, run_id: str, keys: Sequence[str]) -> Claim:
    """This run's claim file, written and locked (removed again if it cannot be written whole)."""
    path = folder / f"{run_id}{_SUFFIX}"
    return Claim(hold_new(path, "\n".join([f"{run_id} {os.getpid()}", *keys]).encode() + b"\n"), path)


# Retention: run folders beyond the newest keep_runs() are removed when a run folder is made and by
# `levers9 runs clean`; runs whose caller is still alive, and folders still being made, never are.

KEEP_RUNS = 50  # run folders kept when a new one is created ($LEVERS9_KEEP_RUNS overrides)


def keep_runs() -> int:
    """How many run folders retention keeps: $LEVERS9_KEEP_RUNS, else KEEP_RUNS."""
    text = os.environ.get("LEVERS9_KEEP_RUNS", "")
    if not text:
        return KEEP_RUNS
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"LEVERS9_KEEP_RUNS={text!r}: expected a whole number of runs, 1 or more. Unset it for {KEEP_RUNS}.")
    return value


def clean(*, keep: int | None = None, older_than: float | None = None, now: float | None = None) -> list[Path]:
    """Remove run folders beyond the newest `keep` and those started more than `older_than` seconds
    ago; a run whose caller is alive, or one still being made, is never removed (a folder whose
    run.json cannot be read counts from its modification time). Returns what was removed."""
    now = time.time() if now is None else now
    _remove_orphans()
    folders = []
    for path, found in each_run_folder():
        run = found if isinstance(found, Run) else None
        folders.append((path, run.started if run is not None else mtime(path), run))
    folders.sort(key=lambda item: (item[1], item[0].name))
    doomed: list[tuple[Path, Run | None]] = []
    if keep is not None:
        doomed += [(path, run) for path, _, run in folders[: max(0, len(folders) - keep)]]
    if older_than is not None:
        doomed += [(p, r) for p, started, r in folders if now - started > older_than and (p, r) not in doomed]
    removed = []
    for path, run in doomed:
        if run is not None and run.alive:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _remove_orphans() -> None:
    """Remove folders being made (.new-<pid>-...) whose maker has died."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in os.scandir(runs_dir()):
            pid = entry.name.removeprefix(NEW_PREFIX).partition("-")[0]
            if entry.name.startswith(NEW_PREFIX) and pid.isdigit() and not pid_alive(int(pid)):
                shutil.rmtree(entry.path, ignore_errors=True)
