"""Card leases shared by every process of this user on this machine: flock, all or nothing, first come first served.

Layout of a pool's lease folder:
    alloc.mutex          held (LOCK_EX) for each allocation attempt, briefly
    next_ticket          the ticket counter, changed only under the mutex
    queue/<ticket>.lock  one per waiting job, locked by it while it waits; holds the slots it may use
    <card>.lock          one per card, locked by the job that holds the card

A waiting job may take cards only when no older live ticket wants any card it could use (strict
first-come-first-served per card, so a 4-card job is not starved by a stream of 1-card jobs), and
then takes all its cards at once or none (never holding some while waiting for others). A ticket
whose lock can be taken belongs to a process that died, and is removed. A card lock lives on the
open file description that the job process inherits, so a job that dies frees its cards through
the kernel: no clean-up step exists or is needed.

A lease folder that cannot be written (its state folder full or read-only) never costs a job: the
folder's queue moves, once, to the fallback folder (`settings.lease_dirs`), with one warning. A card
is taken by locking its lock file in the folder this caller queues in, then in the other folder
wherever the file exists (read-only is enough for flock): whichever of two callers checks last sees
the other's lock, so cards stay exclusive; first-come-first-served order is kept per folder only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from levers9 import state_files
from levers9.errors import PrivateDirError
from levers9.private_dir import check_private, private_dir
from levers9.procs import fds

log = logging.getLogger("levers9.launch")

# What a folder that cannot be written raises: full, read-only, or not ours to write.
UNWRITABLE = (*state_files.FULL, errno.EROFS, errno.EACCES, errno.EPERM)
T = TypeVar("T")
_warned: set[Path] = set()  # lease folders whose move this process has warned about
_move_lock = threading.Lock()


@dataclasses.dataclass
class Ticket:
    """A place in the queue: held (flocked) by its waiter until it is served or dropped."""

    number: int
    fd: int
    path: Path
    eligible: frozenset[int]


class Lease:
    """Cards held through open lock descriptors; they are free again once every copy is closed."""

    def __init__(self, slots: list[int], fds_: list[int]) -> None:
        self.slots = slots
        self.fds = fds_

    def release(self) -> None:
        for fd in self.fds:
            fds.close(fd)
        self.fds = []


class LeaseDir:
    """The lease folder of one pool of cards (and where it moves when it cannot be written)."""

    def __init__(self, path: Path, lock_names: list[str], fallback: Path | None = None) -> None:
        self.path = path
        self.fallback = fallback
        self.home = path  # where this caller queues and creates lock files: `path`, or `fallback` once moved
        self.lock_names = lock_names
        self._in_home(lambda home: (private_dir(home) / "queue").mkdir(exist_ok=True))

    def _in_home(self, step: Callable[[Path], T]) -> T:
        """step(home folder), done again in the fallback folder if the home folder cannot be written."""
        while True:
            home = self.home
            try:
                return step(home)
            except OSError as exc:
                self._move(exc, home)

    def _move(self, exc: OSError, failed: Path) -> None:
        """Queue in the fallback folder from now on, `exc` having been raised in folder `failed`; re-raise
        `exc` if it is not for want of room or write access, or if the fallback folder failed too."""
        unwritable = exc.errno in UNWRITABLE and not (isinstance(exc, PrivateDirError) and exc.errno is None)
        if not unwritable or failed != self.path or self.fallback is None:
            raise exc
        with _move_lock:  # the lanes of one sweep share this LeaseDir
            if self.home == self.fallback:
                return  # another lane moved it already
            (private_dir(self.fallback) / "queue").mkdir(exist_ok=True)
            self.home = self.fallback
            if self.path in _warned:
                return
            _warned.add(self.path)
            log.warning(
                "the card lease folder %s %s; card leases are kept in %s instead (cards are still never shared "
                "with another caller). %s.", self.path, state_files.why(exc), self.fallback, state_files.MOVE_IT,
            )

    def _other(self, home: Path) -> Path | None:
        """The folder other callers may lock cards in (not `home`, where this caller queues), if it is ours."""
        other = self.fallback if home == self.path else self.path
        try:
            return other if other is not None and check_private(other) else None
        except PrivateDirError:
            return None  # no caller of ours keeps locks there: private_dir refuses it to them too

    def take_ticket(self, eligible: list[int]) -> Ticket:
        """Join the queue now (tickets are served in the order they are taken) for cards among `eligible`."""
        return self._in_home(lambda home: self._take_ticket(home, eligible))

    def _take_ticket(self, home: Path, eligible: list[int]) -> Ticket:
        with state_files.held(home / "alloc.mutex"):
            counter = home / "next_ticket"
            try:
                number = int(counter.read_text() or "0")
            except (FileNotFoundError, ValueError):
                number = 0
            state_files.write_atomic(counter, str(number + 1).encode())
            path = home / "queue" / f"{number:012d}.lock"
            fd = state_files.hold_new(path, ",".join(map(str, eligible)).encode())
            return Ticket(number, fd, path, frozenset(eligible))

    def drop_ticket(self, ticket: Ticket) -> None:
        """Leave the queue (a no-op for a ticket already served or dropped)."""
        if ticket.fd < 0:
            return
        with contextlib.suppress(OSError), state_files.held(ticket.path.parent.parent / "alloc.mutex"):
            os.unlink(ticket.path)  # (in a folder that cannot be written, its closed lock marks it dead)
        fds.close(ticket.fd)
        ticket.fd = -1

    def acquire(
        self,
        ticket: Ticket,
        count: int,
        groups: list[list[int]],
        *,
        should_stop: Callable[[], bool] = lambda: False,
        excluded: Callable[[], frozenset[int]] = frozenset,
        timeout: float | None = None,
    ) -> Lease | None:
        """Wait with `ticket` (used up either way) for `count` free cards from one of `groups` (slot lists,
        in preference order); None if `should_stop()` turns true first; TimeoutError after `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.005
        try:
            while True:
                if should_stop():
                    return None
                if ticket.path.parent.parent != self.home:  # the queue moved: join the new one
                    self.drop_ticket(ticket)
                    ticket = self.take_ticket(sorted(ticket.eligible))
                lease = self._serve(ticket, count, groups, excluded())
                if lease is not None:
                    return lease
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"no {count} free cards within {timeout} s")
                time.sleep(pause)
                pause = min(pause * 1.5, 0.05)
        finally:
            self.drop_ticket(ticket)

    def _serve(self, ticket: Ticket, count: int, groups: list[list[int]], excluded: frozenset[int]) -> Lease | None:
        """The cards, if `ticket` is first in line for them and they are free now (None after a move)."""
        home = ticket.path.parent.parent
        try:
            with state_files.held(home / "alloc.mutex"):
                if self._first_in_line(home, ticket.number, ticket.eligible):
                    return self._try_take(home, count, groups, excluded)
            return None
        except OSError as exc:
            self._move(exc, home)
            return None

    def _first_in_line(self, home: Path, ticket: int, eligible: frozenset[int]) -> bool:
        """True if no older live ticket wants a card this one could use; removes tickets of dead waiters."""
        for name in sorted(os.listdir(home / "queue")):
            stem = name.partition(".")[0]
            if not stem.isdigit() or int(stem) >= ticket:
                continue
            path = home / "queue" / name
            try:
                fd = fds.open_fd(str(path), os.O_RDWR)
            except FileNotFoundError:
                continue
            try:
                if state_files.lock_now(fd):
                    os.unlink(path)  # its waiter died without cleaning up
                    continue
                wanted = os.pread(fd, 4096, 0).decode()
                if eligible & {int(s) for s in wanted.split(",") if s}:
                    return False
            finally:
                fds.close(fd)
        return True

    def _try_take(self, home: Path, count: int, groups: list[list[int]], excluded: frozenset[int]) -> Lease | None:
        other = self._other(home)
        for group in groups:
            taken: list[tuple[int, list[int]]] = []
            for slot in group:
                if slot in excluded:
                    continue
                held = self._lock_card(home, self.lock_names[slot], other)
                if held is None:
                    continue
                taken.append((slot, held))
                if len(taken) == count:
                    return Lease([s for s, _ in taken], [f for _, held in taken for f in held])
            for _, held in taken:
                for fd in held:
                    fds.close(fd)
        return None

    def _lock_card(self, home: Path, name: str, other: Path | None) -> list[int] | None:
        """The descriptors that hold card `name`: its lock file in `home` (created if missing), then in
        `other` if it exists there; None if another caller holds either. OSError if it cannot be made."""
        fd = fds.open_fd(str(home / f"{name}.lock"), os.O_RDWR | os.O_CREAT)
        held = [fd]
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if other is not None:
                try:
                    held.append(fds.open_fd(str(other / f"{name}.lock"), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW))
                except OSError as exc:
                    if exc.errno not in (errno.ENOENT, errno.ELOOP):
                        raise
                else:
                    fcntl.flock(held[1], fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            for each in held:
                fds.close(each)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return None
            raise
        return held

    def free_slots(self) -> list[int]:
        """Slots whose lock nobody holds right now (for messages and tests)."""
        free = []
        for slot, name in enumerate(self.lock_names):
            held = self._in_home(lambda home: self._lock_card(home, name, self._other(home)))  # noqa: B023 - called at once
            if held is not None:
                free.append(slot)
                for fd in held:
                    fds.close(fd)
        return free

