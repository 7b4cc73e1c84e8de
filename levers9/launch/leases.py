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
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from levers9.private_dir import private_dir
from levers9.procs import fds


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
        """Close this process's copies of the lock descriptors."""
        for fd in self.fds:
            fds.close(fd)
        self.fds = []


class LeaseDir:
    """The lease folder of one pool of cards."""

    def __init__(self, path: Path, lock_names: list[str]) -> None:
        self.path = path
        self.lock_names = lock_names
        (private_dir(path) / "queue").mkdir(exist_ok=True)

    @contextmanager
    def _mutex(self) -> Iterator[None]:
        fd = fds.open_fd(str(self.path / "alloc.mutex"), os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fds.close(fd)

    def take_ticket(self, eligible: list[int]) -> Ticket:
        """Join the queue now (tickets are served in the order they are taken) for cards among `eligible`."""
        with self._mutex():
            counter = self.path / "next_ticket"
            try:
                number = int(counter.read_text() or "0")
            except (FileNotFoundError, ValueError):
                number = 0
            tmp = self.path / f".next_ticket.{os.getpid()}.{threading.get_ident()}"
            tmp.write_text(str(number + 1))
            os.replace(tmp, counter)
            path = self.path / "queue" / f"{number:012d}.lock"
            fd = fds.open_fd(str(path), os.O_RDWR | os.O_CREAT | os.O_TRUNC)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, ",".join(map(str, eligible)).encode())
            return Ticket(number, fd, path, frozenset(eligible))

    def drop_ticket(self, ticket: Ticket) -> None:
        """Leave the queue (a no-op for a ticket already served or dropped)."""
        if ticket.fd < 0:
            return
        with self._mutex():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(ticket.path)
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
        """Wait with `ticket` for `count` free cards from one of `groups` (slot lists, in preference order).

        The ticket is used up either way. Returns None if `should_stop()` turns true while waiting;
        raises TimeoutError after `timeout` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.005
        try:
            while True:
                if should_stop():
                    return None
                with self._mutex():
                    if self._first_in_line(ticket.number, ticket.eligible):
                        lease = self._try_take(count, groups, excluded())
                        if lease is not None:
                            return lease
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"no {count} free cards within {timeout} s")
                time.sleep(pause)
                pause = min(pause * 1.5, 0.05)
        finally:
            self.drop_ticket(ticket)

    def _first_in_line(self, ticket: int, eligible: frozenset[int]) -> bool:
        """True if no older live ticket wants a card this one could use; removes tickets of dead waiters."""
        for name in sorted(os.listdir(self.path / "queue")):
            stem = name.partition(".")[0]
            if not stem.isdigit() or int(stem) >= ticket:
                continue
            path = self.path / "queue" / name
            try:
                fd = fds.open_fd(str(path), os.O_RDWR)
            except FileNotFoundError:
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as exc:
                    if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise
                    wanted = os.pread(fd, 4096, 0).decode()
                    if eligible & {int(s) for s in wanted.split(",") if s}:
                        return False
                else:
                    os.unlink(path)  # its waiter died without cleaning up
            finally:
                fds.close(fd)
        return True

    def _try_take(self, count: int, groups: list[list[int]], excluded: frozenset[int]) -> Lease | None:
        for group in groups:
            taken: list[tuple[int, int]] = []
            for slot in group:
                if slot in excluded:
                    continue
                fd = fds.open_fd(str(self.path / f"{self.lock_names[slot]}.lock"), os.O_RDWR | os.O_CREAT)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    fds.close(fd)
                    continue
                taken.append((slot, fd))
                if len(taken) == count:
                    return Lease([s for s, _ in taken], [f for _, f in taken])
            for _, fd in taken:
                fds.close(fd)
        return None

    def free_slots(self) -> list[int]:
        """Slots whose lock nobody holds right now (for messages and tests)."""
        free = []
        for slot, name in enumerate(self.lock_names):
            fd = fds.open_fd(str(self.path / f"{name}.lock"), os.O_RDWR | os.O_CREAT)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                free.append(slot)
            except OSError:
                pass
            finally:
                fds.close(fd)
        return free
