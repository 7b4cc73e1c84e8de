"""Which cells a caller is running now, so that two resumes of one sweep run each unfinished cell once.

    <runs_dir>/../claims/mutex           held (LOCK_EX) while a caller checks the claims and adds its own
    <runs_dir>/../claims/<run id>.claim  "<run id> <pid>", then the keys of its cells, one a line;
                                         locked by its run from before its cells start until its record closes

Every batch claims its cells' keys; a batch with resume=True first waits while a live run (one whose
claim file is still locked) claims any of its keys, then takes its claim, and only then looks for
stored results, so it reuses what that run computed instead of running it again. A claim whose
lock can be taken belongs to a caller that died, and is removed. A state folder where claims cannot
be made (full, read-only) claims nothing: resume could not find results there either.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

from levers9.private_dir import private_dir
from levers9.procs import fds
from levers9.state_files import held, hold_new, lock_now, read_private

log = logging.getLogger("levers9.launch")

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
