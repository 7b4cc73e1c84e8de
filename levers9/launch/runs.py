"""Run folders: one per batch, holding its record, its cells' logs and results, kept for a while.

    <runs_dir>/<run id>/                 0700; one per map, remote or spawn call
        run.json                         format, name, function key, caller pid, start, cells' arguments;
                                         rewritten with the end time and counts when the batch ends
        events.jsonl                     one JSON line per cell state change (running, retrying, done, failed)
        results/<cell key>.pkl           each successful cell's value, cloudpickled (what resume reuses)
        <index:04d>-<attempt>/           one attempt's stdout.log, stderr.log, meta.json (written by the backends)

A cell's key is a hash of the function's key (module, name, source) and the cell's pickled
arguments (sets in a fixed order, so the key is the same under any hash seed), so a changed function
body or changed inputs make new cells. While a batch runs, its cells' keys are claimed (claims.py):
a resume waits for a live run that claims any of its cells, then reuses what it stored. Everything is read back
only from regular files of this user's that no one else can write (never through a symlink, never
waiting on a FIFO), and every field of run.json and every events.jsonl line is checked: a folder
that fails is passed over with a RunFormatError naming it, never the reason a sweep stops.

A run folder appears whole: made as .new-<pid>-<run id> with its run.json, then renamed. On a full
disk the sweep still runs: unrecorded (said in one line at its start), or with what could not be
kept said in one warning at its end (levers9.state_files).

Retention: when a run folder is created, the oldest beyond the newest KEEP_RUNS (50, or
$LEVERS9_KEEP_RUNS) are removed; runs whose caller is still alive, and folders still being made, are
never removed.
"""

from __future__ import annotations

import contextlib
import copyreg
import dataclasses
import hashlib
import inspect
import io
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

from levers9 import state_files
from levers9.errors import ConfigError, PrivateDirError, RunFormatError
from levers9.launch import claims
from levers9.launch.cells import Cell
from levers9.launch.settings import runs_dir
from levers9.private_dir import private_dir
from levers9.procs.watch import pid_alive
from levers9.seconds import is_seconds
from levers9.state_files import write_atomic

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


STATE_FIX = (
    "set LEVERS9_STATE_DIR to a folder of your own that you can write (e.g. export LEVERS9_STATE_DIR="
    "~/.levers9-state), or XDG_CACHE_HOME to a cache folder you can write"
)
NEW_PREFIX = ".new-"  # .new-<pid>-<run id>: a run folder being made; renamed into place with its run.json
RESERVE = 512  # spaces after run.json's first text: room to write its end in place on a full disk


def runs_root() -> Path:
    """runs_dir(), created private (0700) if missing; PrivateDirError naming LEVERS9_STATE_DIR and
    XDG_CACHE_HOME if it cannot be (a HOME that is not writable); OSError on a full disk."""
    return private_dir(runs_dir(), fix=STATE_FIX)


def _run_path(run_id: str) -> Path:
    """Where run `run_id`'s folder is (as runs_root() names it), without making anything."""
    return Path(os.path.abspath(os.path.expanduser(runs_dir()))) / run_id


def create_run_folder(run_id: str, record: dict[str, Any]) -> Path:
    """Make runs_dir()/run_id holding `record` as its run.json (and an empty results/), applying
    retention first. The folder appears whole (made under a hidden name, then renamed), so another
    caller's retention never sees it without the record that names its living caller. OSError (the
    disk is full) leaves nothing behind."""
    root = runs_root()
    path = root / run_id
    clean(keep=keep_runs() - 1)
    making = root / f"{NEW_PREFIX}{os.getpid()}-{run_id}"
    try:
        os.mkdir(making, 0o700)
        write_atomic(making / RUN_FILE, json.dumps(record, indent=1).encode(), pad=RESERVE)
        os.mkdir(making / RESULTS, 0o700)
        os.rename(making, path)
    except BaseException:
        shutil.rmtree(making, ignore_errors=True)
        raise
    return path


def run_folder(run_id: str) -> Path:
    """runs_dir()/run_id, for a backend: made (with a small record) if no RunRecord made it first; on a
    full disk the path comes back anyway (what is written there is counted as lost)."""
    path = _run_path(run_id)
    if path.is_dir() or state_files.unrecorded(path):
        return path
    record = {"format": FORMAT, "id": run_id, "name": run_id, "backend": "?", "function": "?",
              "pid": os.getpid(), "started": time.time(), "total": 0, "cells": {}}  # fmt: skip
    try:
        return create_run_folder(run_id, record)
    except FileExistsError:
        return path
    except OSError as exc:
        if isinstance(exc, PrivateDirError):
            raise
        state_files.losses(path).unrecorded_run(runs_dir(), run_id, exc)
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
    """A hash of the function's key and the cell's arguments (not its index), the same in every process:
    sets are pickled in a fixed order, not in their hash order (which follows PYTHONHASHSEED)."""
    blob = _canonical_bytes((cell.args, sorted(cell.kwargs.items())))
    return hashlib.sha256(fn_key.encode() + b"\0" + blob).hexdigest()[:40]


class _KeyMark:
    """Stands for 'a set of' or 'the class named' in key bytes (pickled by reference, so no argument can
    look like it)."""


class _KeyPickler(cloudpickle.Pickler):
    """cloudpickle, with every set and frozenset written in the order of its members' own key bytes,
    also inside the state of other objects (pickle calls reducer_override for those, never for a set),
    and a class cloudpickle would copy by value (one made in __main__) by its name instead of its
    random tracker id."""

    def reducer_override(self, obj: Any) -> Any:
        if obj is _KeyMark:
            return NotImplemented
        reduced = super().reducer_override(obj)  # classes and functions by value, as cloudpickle does
        if isinstance(obj, type):
            return reduced if reduced is NotImplemented else (_KeyMark, ("class", obj.__module__, obj.__qualname__))
        if reduced is not NotImplemented:
            return _sets_sorted(reduced, {})
        try:
            reducer = copyreg.dispatch_table.get(type(obj))
            reduced = reducer(obj) if reducer is not None else obj.__reduce_ex__(5)
        except Exception:
            return NotImplemented
        if not isinstance(reduced, tuple):
            return NotImplemented
        canonical = _sets_sorted(reduced, {})
        return canonical if canonical is not reduced else NotImplemented


def _sets_sorted(value: Any, seen: dict[int, Any]) -> Any:
    """`value` with every set inside its lists, tuples and dicts replaced by (_KeyMark, type, sorted
    members); `value` itself (the same object) when it holds no set."""
    kind = type(value)
    if id(value) in seen:
        return seen[id(value)]
    if kind in (set, frozenset):
        members = sorted((_sets_sorted(m, seen) for m in value), key=_canonical_bytes)
        made: Any = (_KeyMark, kind.__name__, tuple(members))
    elif kind in (list, tuple):
        items = [_sets_sorted(v, seen) for v in value]
        made = value if all(a is b for a, b in zip(items, value, strict=True)) else kind(items)
    elif kind is dict:
        pairs = [(_sets_sorted(k, seen), _sets_sorted(v, seen)) for k, v in value.items()]
        same = all(a is k and b is v for (a, b), (k, v) in zip(pairs, value.items(), strict=True))
        made = value if same else dict(pairs)
    else:
        return value
    seen[id(value)] = made
    return made


def _canonical_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    _KeyPickler(buffer, protocol=5).dump(_sets_sorted(value, {}))
    return buffer.getvalue()


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
    """Writes run.json, events.jsonl and results/ of one batch (an Events, plus result storage).

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
        self.path = _run_path(run_id)
        self.losses = state_files.losses(self.path)
        try:
            create_run_folder(run_id, self._meta)
        except OSError as exc:
            if isinstance(exc, PrivateDirError):
                raise
            self.losses.unrecorded_run(runs_dir(), run_id, exc)
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
        found = _stored_results(self.fn_key, exclude=self.path.name)
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
            state_files.report_losses(self.path)
            self._claim.release()
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
    kept, skipped = scan_runs()
    for problem in skipped:
        log.warning("not reusing results from a run folder: %s", problem)
    for run in reversed(kept):
        if run.name_on_disk == exclude or run.meta.get("fn_key") != fn_key or run.newer:
            continue
        results = run.path / RESULTS
        if not (owned_privately(run.path) and owned_privately(results)):
            log.warning("not reusing results from %s: not a private folder of this user", run.path)
            continue
        with contextlib.suppress(OSError):
            for entry in os.scandir(results):
                key = entry.name.removesuffix(".pkl")
                if key not in found and entry.name.endswith(".pkl") and owned_privately(Path(entry.path)):
                    found[key] = Path(entry.path)
    return found


# ---- reading runs back ---------------------------------------------------------------------------

STATES = ("running", "retrying", "done", "failed")


def _is_int(value: Any, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _is_time(value: Any) -> bool:
    return is_seconds(value, zero_ok=True)


def _is_cells(value: Any) -> bool:
    return isinstance(value, dict) and all(k.isdigit() and isinstance(v, str) for k, v in value.items())


# run.json's keys: (what a value must be, as said in messages; the check). The first three are required.
_RECORD: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "format": ("a whole number", _is_int),
    "started": ("a time (seconds since 1970)", _is_time),
    "pid": ("a process id (a whole number, 1 or more)", lambda v: _is_int(v, 1)),
    "ended": ("a time (seconds since 1970) or null", lambda v: v is None or _is_time(v)),
    "total": ("a whole number", _is_int),
    "done": ("a whole number", _is_int),
    "failed": ("a whole number", _is_int),
    "reused": ("a whole number", _is_int),
    "cells": ('an object of cell index to arguments ({"0": "(1,)"})', _is_cells),
    "incomplete": ("true or false", lambda v: isinstance(v, bool)),
    **{key: ("a string", lambda v: isinstance(v, str)) for key in ("id", "name", "backend", "function", "fn_key")},
}


def _event_ok(event: Any) -> bool:
    """An events.jsonl line as levers9 writes it."""
    return (
        isinstance(event, dict)
        and _is_int(event.get("i"))
        and event.get("state") in STATES
        and _is_time(event.get("t"))
        and isinstance(event.get("card", ""), str)
        and _is_int(event.get("attempt", 1), 1)
        and isinstance(event.get("error", ""), str)
        and isinstance(event.get("reused", False), bool)
    )


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
    """A run folder as read back: its run.json (checked), and whether its caller is still alive."""

    path: Path
    meta: dict[str, Any]
    newer: bool = False  # written by a newer levers9: only its name and age are shown
    skipped_events: int = 0  # events.jsonl lines that cells() passed over (cut short or malformed)

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
        """Every cell's last known state, in index order (events.jsonl replayed over run.json's list);
        lines that are cut short or not as levers9 writes them are counted in skipped_events."""
        self.check_readable()
        cells = {int(i): CellState(int(i), text) for i, text in (self.meta.get("cells") or {}).items()}
        self.skipped_events = 0
        try:
            lines = state_files.read_private(self.path / EVENTS_FILE).splitlines()
        except FileNotFoundError:
            lines = []
        except OSError as exc:
            raise RunFormatError(
                f"{self.path}: cannot read {EVENTS_FILE} ({exc.strerror or exc}); expected a file levers9 wrote. "
                f"Remove the folder with: rm -r {self.path}"
            ) from None
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                event = None
            if not _event_ok(event):
                self.skipped_events += 1
                continue
            cell = cells.setdefault(event["i"], CellState(event["i"], "?"))
            cell.state = event["state"]
            if event["state"] == "running":
                cell.card, cell.attempt, cell.started = event.get("card", ""), event.get("attempt", 1), event["t"]
            elif event["state"] in ("done", "failed"):
                cell.ended, cell.error = event["t"], event.get("error", "")
                cell.reused = event.get("reused", False)
        if not self.alive:
            lost = "not recorded" if self.meta.get("incomplete") else None  # the disk was full
            for cell in cells.values():
                if cell.state in ("waiting", "running", "retrying"):
                    cell.state = lost or ("cancelled" if self.ended is not None else "interrupted")
        return [cells[i] for i in sorted(cells)]

    def counts(self) -> tuple[int, int, int]:
        """(done, failed, total)."""
        if self.newer:
            return 0, 0, int(self.meta.get("total") or 0)
        if self.ended is not None and all(k in self.meta for k in ("done", "failed", "total")):
            return int(self.meta["done"]), int(self.meta["failed"]), int(self.meta["total"])
        states = [c.state for c in self.cells()]
        return states.count("done"), states.count("failed"), len(states)


def read_run(path: Path) -> Run:
    """The run in folder `path`; RunFormatError naming the folder, the key and its value if its run.json
    is missing, unreadable or not as levers9 writes it."""
    fix = f"Remove the folder with: rm -r {path}"
    try:
        meta = json.loads(state_files.read_private(path / RUN_FILE))
    except (OSError, ValueError) as exc:
        text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise RunFormatError(
            f"{path} is not a readable run folder ({type(exc).__name__}: {text}); expected a {RUN_FILE} "
            f"written by levers9. {fix}"
        ) from None
    if not isinstance(meta, dict):
        raise RunFormatError(f"{path / RUN_FILE} holds {type(meta).__name__}, not the object levers9 writes. {fix}")
    newer = _is_int(meta.get("format")) and meta["format"] > FORMAT
    for key in ("format", "started", "total") if newer else _RECORD:
        expected, ok = _RECORD[key]
        required = key in ("format", "started", "pid") and not newer
        if (key in meta or required) and not ok(meta.get(key)):
            raise RunFormatError(
                f"{path / RUN_FILE}: {key!r} must be {expected}, got {meta.get(key)!r}; levers9 skips this run. {fix}"
            )
    return Run(path, meta, newer=newer)


def scan_runs() -> tuple[list[Run], list[RunFormatError]]:
    """Every readable run under runs_dir(), oldest first, and the errors of the folders passed over
    (each names its folder). Folders being made (hidden names) are left out."""
    runs, skipped = [], []
    for path in _folders():
        try:
            runs.append(read_run(path))
        except RunFormatError as exc:
            skipped.append(exc)
    return sorted(runs, key=lambda r: (r.started, r.name_on_disk)), skipped


def list_runs() -> list[Run]:
    """Every readable run under runs_dir(), oldest first (see scan_runs for those passed over)."""
    return scan_runs()[0]


def find_run(text: str) -> Run:
    """The run named `text`: its id, a unique prefix of it, or 'last'. ConfigError if none or several;
    the RunFormatError of a folder of that name that cannot be read."""
    runs, skipped = scan_runs()
    if text == "last" and runs:
        return runs[-1]
    matches = [r for r in runs if r.name_on_disk == text] or [r for r in runs if r.name_on_disk.startswith(text)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        for problem in skipped:
            if f"{os.sep}{text}" in str(problem):
                raise problem
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
    ago; a run whose caller is alive, or one still being made, is never removed (a folder whose
    run.json cannot be read counts from its modification time). Returns what was removed."""
    now = time.time() if now is None else now
    _remove_orphans()
    folders = []
    for path in _folders():
        try:
            run: Run | None = read_run(path)
        except RunFormatError:
            run = None
        folders.append((path, run.started if run is not None else _mtime(path), run))
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


def _folders() -> list[Path]:
    """The run folders under runs_dir() (not the hidden ones being made)."""
    found = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in os.scandir(runs_dir()):
            if not entry.name.startswith(".") and entry.is_dir(follow_symlinks=False):
                found.append(Path(entry.path))
    return found


def _remove_orphans() -> None:
    """Remove folders being made (.new-<pid>-...) whose maker has died."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in os.scandir(runs_dir()):
            pid = entry.name.removeprefix(NEW_PREFIX).partition("-")[0]
            if entry.name.startswith(NEW_PREFIX) and pid.isdigit() and not pid_alive(int(pid)):
                shutil.rmtree(entry.path, ignore_errors=True)


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
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue  # not there yet, or a symlink (never followed)
            with open(fd, "rb") as handle:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    continue  # a FIFO is never waited on
                handle.seek(offsets[path])
                data = handle.read()
                end = data.rfind(b"\n") + 1 if going else len(data)
                if end:
                    offsets[path] += end
                    yield data[:end].decode("utf-8", errors="replace")
        if not going:
            return
        time.sleep(every)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
