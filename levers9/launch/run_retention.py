"""Retention: run folders beyond the newest KEEP_RUNS (50, or $LEVERS9_KEEP_RUNS) are removed when a
run folder is made (run_folder.py) and by `levers9 runs clean`; runs whose caller is still alive, and
folders still being made, are never removed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path

from levers9.errors import ConfigError
from levers9.launch.run_reader import NEW_PREFIX, Run, each_run_folder, mtime
from levers9.launch.settings import runs_dir
from levers9.procs.watch import pid_alive

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

