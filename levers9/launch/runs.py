"""Run folders: one per batch, holding its record, its cells' logs and results, kept for a while.

    <runs_dir>/<run id>/                 0700; one per map, remote or spawn call
        run.json                         format, name, function key, caller pid, start, cells' arguments;
                                         rewritten with the end time and counts when the batch ends
        events.jsonl                     one JSON line per cell state change (running, retrying, done, failed)
        results/<cell key>.pkl           each successful cell's value, cloudpickled (what resume reuses)
        <index:04d>-<attempt>/           one attempt's stdout.log, stderr.log, meta.json (written by the backends)

A cell's key is a hash of the function's key (module, name, source) and the cell's pickled
arguments, so a changed function body or changed inputs make new cells. Results are read back only
from folders and files owned by this user and writable by no one else.

Retention: when a run folder is created, the oldest beyond the newest KEEP_RUNS (50, or
$LEVERS9_KEEP_RUNS) are removed; runs whose caller is still alive are never removed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import json
import logging
import marshal
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import cloudpickle

from levers9.errors import ConfigError, RunFormatError
from levers9.launch.cells import Cell
from levers9.launch.settings import runs_dir
from levers9.private_dir import private_dir
from levers9.procs.watch import pid_alive

log = logging.getLogger("levers9.launch")

FORMAT = 1  # run.json's "format"; a reader refuses a larger number
KEEP_RUNS = 50  # run folders kept when a new one is created ($LEVERS9_KEEP_RUNS overrides)
RUN_FILE = "run.json"
EVENTS_FILE = "events.jsonl"
RESULTS = "results"


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


def run_folder(run_id: str) -> Path:
    """runs_dir()/run_id, created private (0700) if missing; creating one applies retention first."""
    root = private_dir(runs_dir())
    path = root / run_id
    if not path.is_dir():
        clean(keep=keep_runs() - 1)
        path.mkdir(mode=0o700, exist_ok=True)
    return path


# ---- keys -----------------------------------------------------------------------------------------


def function_key(func: Callable[..., Any]) -> str:
    """A hash of what the function is: module, qualified name and source (the code object without source)."""
    try:
        body = inspect.getsource(func).encode()
    except (OSError, TypeError):
        code = getattr(func, "__code__", None)
        body = marshal.dumps(code) if code is not None else cloudpickle.dumps(func)
    name = f"{getattr(func, '__module__', '')}:{getattr(func, '__qualname__', '')}"
    return hashlib.sha256(name.encode() + b"\0" + body).hexdigest()[:32]


def cell_key(fn_key: str, cell: Cell) -> str:
    """A hash of the function's key and the cell's arguments (not its index)."""
    blob = cloudpickle.dumps((cell.args, sorted(cell.kwargs.items())))
    return hashlib.sha256(fn_key.encode() + b"\0" + blob).hexdigest()[:40]


# ---- ownership -----------------------------------------------------------------------------------


def owned_privately(path: Path) -> bool:
    """True if `path` is ours, not a symlink, and writable by no one else (safe to unpickle from)."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return (
        not stat.S_ISLNK(info.st_mode)
        and info.st_uid == os.getuid()
        and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )


# ---- the record of one batch, written while it runs -------------------------------------------------


class RunRecord:
    """Writes run.json, events.jsonl and results/ of one batch (an Events, plus result storage)."""

    def __init__(
        self, run_id: str, *, name: str, backend: str, func: Callable[..., Any], cells: Sequence[Cell]
    ) -> None:
        self.path = run_folder(run_id)
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
        self.closed = threading.Event()  # set once run.json has its end (and every result was stored)
        self.done = 0
        self.failed = 0
        self.reused = 0
        _write_json(self.path / RUN_FILE, self._meta)
        (self.path / RESULTS).mkdir(mode=0o700, exist_ok=True)
        self._events = open(self.path / EVENTS_FILE, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def _event(self, cell: Cell, state: str, **extra: Any) -> None:
        line = json.dumps({"i": cell.index, "state": state, "t": round(time.time(), 3), **extra})
        with self._lock:
            if not self._events.closed:
                self._events.write(line + "\n")
                self._events.flush()

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

    def output(self, cell: Cell, stream: str, line: str) -> None:
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
        _write_private(self.path / RESULTS / f"{self.keys[cell.index]}.pkl", blob)

    def reuse(self, cells: Sequence[Cell]) -> dict[int, Any]:
        """Values of `cells` that a kept run with this function already computed, by cell index; each
        reused result is linked into this run too, so this run alone holds every result it returns."""
        found = _stored_results(self.fn_key, exclude=self.path.name)
        values: dict[int, Any] = {}
        for cell in cells:
            source = found.get(self.keys[cell.index])
            if source is None:
                continue
            try:
                values[cell.index] = cloudpickle.loads(source.read_bytes())
            except Exception as exc:
                log.warning("not reusing %s (%s: %s); running that cell again", source, type(exc).__name__, exc)
                continue
            target = self.path / RESULTS / source.name
            try:
                os.link(source, target)
            except OSError:
                with contextlib.suppress(OSError):
                    shutil.copyfile(source, target)
            self._event(cell, "done", reused=True)
        self.reused = len(values)
        self.done += len(values)
        return values

    def close(self) -> None:
        """Write the end time and counts into run.json and close the events file (idempotent)."""
        with self._lock:
            if self._events.closed:
                return
            self._events.close()
        self._meta.update(ended=time.time(), done=self.done, failed=self.failed, reused=self.reused)
        with contextlib.suppress(OSError):
            _write_json(self.path / RUN_FILE, self._meta)
        self.closed.set()


    def discard(self) -> None:
        """Close and remove the run folder: the batch was refused before anything ran."""
        self.close()
        shutil.rmtree(self.path, ignore_errors=True)


def describe_error(error: BaseException) -> str:
    """'ValueError: boom' (first line of the message only)."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def _stored_results(fn_key: str, *, exclude: str) -> dict[str, Path]:
    """cell key -> result file, from the kept runs of the function `fn_key`, newest run first."""
    found: dict[str, Path] = {}
    for run in reversed(list_runs()):
        if run.name_on_disk == exclude or run.meta.get("fn_key") != fn_key or run.newer:
            continue
        results = run.path / RESULTS
        if not (owned_privately(run.path) and owned_privately(results)):
            log.warning("not reusing results from %s: not a private folder of this user", run.path)
            continue
        with contextlib.suppress(OSError):
            for entry in os.scandir(results):
                key = entry.name.removesuffix(".pkl")
                if key not in found and owned_privately(Path(entry.path)):
                    found[key] = Path(entry.path)
    return found


# ---- reading runs back ---------------------------------------------------------------------------


@dataclasses.dataclass
class CellState:
    """What the record says about one cell."""

    index: int
    args: str
    state: str = "waiting"
    card: str = ""
    attempt: int = 0
    started: float | None = None
    ended: float | None = None
    error: str = ""
    reused: bool = False


@dataclasses.dataclass
class Run:
    """A run folder as read back: its run.json, and whether its caller is still alive."""

    path: Path
    meta: dict[str, Any]
    newer: bool = False  # written by a newer levers9: only its name and age are shown

    @property
    def name_on_disk(self) -> str:
        return self.path.name

    @property
    def started(self) -> float:
        return float(self.meta.get("started") or _mtime(self.path))

    @property
    def ended(self) -> float | None:
        value = self.meta.get("ended")
        return None if value is None else float(value)

    @property
    def alive(self) -> bool:
        """The caller is still running it (no end written and its pid exists)."""
        return self.ended is None and pid_alive(int(self.meta.get("pid") or 0))

    @property
    def status(self) -> str:
        if self.newer:
            return "newer format"
        if self.ended is not None:
            return "ended"
        return "running" if self.alive else "interrupted"

    def check_readable(self) -> None:
        """RunFormatError if this levers9 cannot read the folder's record."""
        if self.newer:
            raise RunFormatError(
                f"run {self.path.name} was written by a newer levers9 (run format {self.meta.get('format')}; "
                f"this levers9 reads format {FORMAT}). Upgrade levers9 (pip install -U levers9) to read it."
            )

    def cells(self) -> list[CellState]:
        """Every cell's last known state, in index order (events.jsonl replayed over run.json's list)."""
        self.check_readable()
        cells = {int(i): CellState(int(i), text) for i, text in (self.meta.get("cells") or {}).items()}
        with contextlib.suppress(FileNotFoundError), open(self.path / EVENTS_FILE, encoding="utf-8") as events:
            for line in events:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a crash
                cell = cells.setdefault(int(event["i"]), CellState(int(event["i"]), "?"))
                cell.state = event["state"]
                if event["state"] == "running":
                    cell.card, cell.attempt, cell.started = event.get("card", ""), event.get("attempt", 1), event["t"]
                elif event["state"] in ("done", "failed"):
                    cell.ended, cell.error = event["t"], event.get("error", "")
                    cell.reused = bool(event.get("reused"))
        if not self.alive:
            for cell in cells.values():
                if cell.state in ("waiting", "running", "retrying"):
                    cell.state = "cancelled" if self.ended is not None else "interrupted"
        return [cells[i] for i in sorted(cells)]

    def counts(self) -> tuple[int, int, int]:
        """(done, failed, total)."""
        if self.newer:
            return 0, 0, int(self.meta.get("total") or 0)
        if self.ended is not None and "done" in self.meta:
            return int(self.meta["done"]), int(self.meta["failed"]), int(self.meta["total"])
        states = [c.state for c in self.cells()]
        return states.count("done"), states.count("failed"), len(states)


def read_run(path: Path) -> Run:
    """The run in folder `path`; RunFormatError if it has no readable run.json."""
    try:
        meta = json.loads((path / RUN_FILE).read_text())
        version = int(meta["format"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RunFormatError(
            f"{path} is not a readable run folder ({type(exc).__name__}: {exc}); expected a {RUN_FILE} "
            f"written by levers9. Remove it with: levers9 runs clean --older-than 0s"
        ) from None
    return Run(path, meta, newer=version > FORMAT)


def list_runs() -> list[Run]:
    """Every readable run under runs_dir(), oldest first (folders without a record are left out)."""
    root = runs_dir()
    runs = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(root):
            if entry.is_dir(follow_symlinks=False):
                with contextlib.suppress(RunFormatError):
                    runs.append(read_run(Path(entry.path)))
    return sorted(runs, key=lambda r: (r.started, r.name_on_disk))


def find_run(text: str) -> Run:
    """The run named `text`: its id, a unique prefix of it, or 'last'. ConfigError if none or several."""
    runs = list_runs()
    if text == "last" and runs:
        return runs[-1]
    matches = [r for r in runs if r.name_on_disk == text] or [r for r in runs if r.name_on_disk.startswith(text)]
    if len(matches) == 1:
        return matches[0]
    recent = ", ".join(r.name_on_disk for r in runs[-3:]) or "none yet"
    if not matches:
        raise ConfigError(
            f"no run {text!r} under {runs_dir()}; recent runs: {recent}. List them with: levers9 runs"
        )
    raise ConfigError(
        f"{text!r} matches {len(matches)} runs ({', '.join(r.name_on_disk for r in matches[:5])}); "
        f"give more of the id. List them with: levers9 runs"
    )


def clean(*, keep: int | None = None, older_than: float | None = None, now: float | None = None) -> list[Path]:
    """Remove run folders beyond the newest `keep` and those started more than `older_than` seconds
    ago; a run whose caller is alive is never removed. Returns what was removed."""
    now = time.time() if now is None else now
    folders = _run_folders()
    doomed: list[Path] = []
    if keep is not None:
        doomed += [path for path, _ in folders[: max(0, len(folders) - keep)]]
    if older_than is not None:
        doomed += [path for path, started in folders if now - started > older_than and path not in doomed]
    removed = []
    for path in doomed:
        with contextlib.suppress(RunFormatError):
            if read_run(path).alive:
                continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _run_folders() -> list[tuple[Path, float]]:
    """(folder, start time) of everything under runs_dir(), oldest first; a folder without a
    readable record counts from its modification time."""
    found = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(runs_dir()):
            if not entry.is_dir(follow_symlinks=False):
                continue
            path = Path(entry.path)
            try:
                started = read_run(path).started
            except RunFormatError:
                started = _mtime(path)
            found.append((path, started))
    return sorted(found, key=lambda item: (item[1], item[0].name))


def attempt_folders(run: Run, index: int) -> list[Path]:
    """The attempt folders of cell `index`, first attempt first."""
    prefix = f"{index:04d}-"
    found = [p for p in run.path.glob(prefix + "*") if p.is_dir() and p.name[len(prefix) :].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(prefix) :]))


def follow(paths: Sequence[Path], still_going: Callable[[], bool], every: float = 0.2) -> Iterator[str]:
    """Yield what is appended to `paths` (whole lines) until still_going() is false and all is read."""
    offsets = {p: 0 for p in paths}
    while True:
        going = still_going()  # read before the files, so the last lines are never missed
        for path in paths:
            with contextlib.suppress(FileNotFoundError), open(path, "rb") as handle:
                handle.seek(offsets[path])
                data = handle.read()
                end = data.rfind(b"\n") + 1 if going else len(data)
                if end:
                    offsets[path] += end
                    yield data[:end].decode("utf-8", errors="replace")
        if not going:
            return
        time.sleep(every)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    _write_private(path, json.dumps(data, indent=1).encode())


def _write_private(path: Path, blob: bytes) -> None:
    """Write `blob` to `path` atomically, readable by this user only."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open(fd, "wb") as handle:
        handle.write(blob)
    os.replace(partial, path)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
