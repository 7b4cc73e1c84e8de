"""Run folders read back: their records checked, their cells' states replayed, their logs followed.

    <runs_dir>/<run id>/                 0700; one per map, remote or spawn call
        run.json                         format, name, function key, caller pid, start, cells' arguments;
                                         rewritten with the end time and counts when the batch ends
        events.jsonl                     one JSON line per cell state change (running, retrying, done, failed)
        results/<cell key>.pkl           each successful cell's value, cloudpickled (what resume reuses)
        <index:04d>-<attempt>/           one attempt's stdout.log, stderr.log, meta.json (written by the backends)

run_folder.py writes them and removes old ones. Everything is read back only from
regular files of this user's that no one else can write (never through a symlink, never waiting on
a FIFO), and every field of run.json and every events.jsonl line is checked: a folder that fails is
passed over with a RunFormatError naming it, never the reason a sweep stops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from levers9 import state_files
from levers9.errors import ConfigError, RunFormatError
from levers9.launch.settings import runs_dir
from levers9.procs.watch import pid_alive
from levers9.seconds import is_seconds

log = logging.getLogger("levers9.launch")

FORMAT = 1  # run.json's "format"; a reader refuses a larger number
RUN_FILE = "run.json"
EVENTS_FILE = "events.jsonl"
RESULTS = "results"
NEW_PREFIX = ".new-"  # .new-<pid>-<run id>: a run folder being made; renamed into place with its run.json
STATES = ("running", "retrying", "done", "failed")


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
    value: str = ""  # a detached SLURM cell's value (its repr, cut short): slurm_collect.detached_cells

    @property
    def took(self) -> float | None:
        """Seconds from its (latest) start to its end; None unless both are known."""
        return None if self.started is None or self.ended is None else self.ended - self.started


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
        return float(self.meta.get("started") or mtime(self.path))

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

    def cells(self) -> list[CellState]:
        """Every cell's last known state, in index order (events.jsonl replayed over run.json's list);
        lines that are cut short or not as levers9 writes them are counted in skipped_events."""
        if self.newer:
            raise RunFormatError(
                f"run {self.path.name} was written by a newer levers9 (run format {self.meta.get('format')}; "
                f"this levers9 reads format {FORMAT}). Upgrade levers9 (pip install -U levers9) to read it."
            )
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

    def cell(self, index: int) -> CellState:
        """Cell #`index` as cells() gives it; ConfigError naming the cells the run has if it has no such cell."""
        cells = self.cells()
        for cell in cells:
            if cell.index == index:
                return cell
        raise ConfigError(
            f"run {self.name_on_disk} has no cell #{index}; it has cells #0 to #{len(cells) - 1}. "
            f"See them with: levers9 runs show {self.name_on_disk}"
        )

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


def each_run_folder() -> Iterator[tuple[Path, Run | RunFormatError]]:
    """Every run folder under runs_dir() (not the hidden ones being made) with its run, or the
    RunFormatError that says why it cannot be read."""
    found = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in os.scandir(runs_dir()):
            if not entry.name.startswith(".") and entry.is_dir(follow_symlinks=False):
                found.append(Path(entry.path))
    for path in found:
        try:
            yield path, read_run(path)
        except RunFormatError as exc:
            yield path, exc


def scan_runs() -> tuple[list[Run], list[RunFormatError]]:
    """Every readable run under runs_dir(), oldest first, and the errors of the folders passed over
    (each names its folder). Folders being made (hidden names) are left out."""
    runs, skipped = [], []
    for _, found in each_run_folder():
        if isinstance(found, Run):
            runs.append(found)
        else:
            skipped.append(found)
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
        raise ConfigError(
            f"no run {text!r} under {runs_dir()}; recent runs: {recent}. List them with: levers9 runs"
        )
    raise ConfigError(
        f"{text!r} matches {len(matches)} runs ({', '.join(r.name_on_disk for r in matches[:5])}); "
        f"give more of the id. List them with: levers9 runs"
    )


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


def mtime(path: Path) -> float:
    """`path`'s modification time; 0.0 if it cannot be read."""
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def stored_results(fn_key: str, *, exclude: str) -> dict[str, Path]:
    """cell key -> result file, from the kept runs of the function `fn_key`, newest run first (what
    resume reuses); runs that are not private folders of this user are passed over, said in a warning."""
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
