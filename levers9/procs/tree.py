"""Both sides: a child's whole process tree, read from /proc, the parts that left its process group or session included.

A levers9 child makes itself a child subreaper (Linux's PR_SET_CHILD_SUBREAPER): a process whose parent
dies (a daemon's double fork) is re-parented to the child instead of to PID 1, so it stays in the
child's tree. The child stops its whole tree when its target returns (`end_descendants`), and the
parent, stopping a child early, finds the child's descendants that left its process group
(`outside_group`) while the child still lives. What was re-parented to PID 1 because the child itself
died first (SIGKILL, a crash, os._exit) cannot be found again.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Make orphaned descendants of this process its children (Linux; elsewhere nothing happens)."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _table() -> dict[int, tuple[int, int, str]]:
    """Every process's (parent, process group, state letter), read from /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        table[int(entry)] = (int(fields[1]), int(fields[2]), fields[0].decode())
    return table


def descendants(root: int, table: dict[int, tuple[int, int, str]] | None = None) -> list[int]:
    """Live (not zombie) descendants of `root`, parents before their children."""
    table = _table() if table is None else table
    below: dict[int, list[int]] = {}
    for pid, (ppid, _, state) in table.items():
        if state != "Z":
            below.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        for pid in below.get(todo.pop(), []):
            found.append(pid)
            todo.append(pid)
    return found


def outside_group(root: int) -> list[int]:
    """Pidfds of `root`'s live descendants that are not in its process group (a signal to the group misses them)."""
    table = _table()
    return _open([pid for pid in descendants(root, table) if table[pid][1] != root])


def _open(pids: list[int]) -> list[int]:
    handles = []
    for pid in pids:
        with contextlib.suppress(OSError):
            handles.append(os.pidfd_open(pid))
    return handles


def signal_all(pidfds: list[int], signum: int) -> None:
    """Send `signum` to each process (one that has ended is skipped)."""
    for pidfd in pidfds:
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(pidfd, signum)


def kill_trees(pidfds: list[int]) -> None:
    """SIGKILL each process and every descendant it has, freezing each with SIGSTOP first so none of them
    forks a process that is missed; closes the pidfds."""
    try:
        signal_all(pidfds, signal.SIGSTOP)
        seen = {_pid_of(fd) for fd in pidfds}
        for _ in range(100):
            table = _table()
            new = [p for root in list(seen) for p in descendants(root, table) if p not in seen]
            if not new:
                break
            opened = _open(new)
            signal_all(opened, signal.SIGSTOP)
            pidfds = pidfds + opened
            seen.update(new)
        signal_all(pidfds, signal.SIGKILL)
    finally:
        for fd in pidfds:
            with contextlib.suppress(OSError):
                os.close(fd)


def _pid_of(pidfd: int) -> int:
    with contextlib.suppress(OSError, ValueError):
        with open(f"/proc/self/fdinfo/{pidfd}") as f:
            for line in f:
                if line.startswith("Pid:"):
                    return int(line.split()[1])
    return -1


def end_descendants(seconds: float = 2.0) -> None:
    """In a subreaper: SIGKILL every descendant of this process and reap those that became its children,
    for at most `seconds` (re-parented grandchildren are found on the next round)."""
    me, end = os.getpid(), time.monotonic() + seconds
    while _has_children() and time.monotonic() < end:  # in a subreaper, a descendant implies a child
        table = _table()
        live = descendants(me, table)
        mine = [pid for pid, (ppid, _, _) in table.items() if ppid == me]
        if not live and not mine:
            return
        kill_trees(_open(live))
        for pid in mine:
            _reap(pid, end)


def _has_children() -> bool:
    """True if this process has a child, live or not yet reaped (none of them is reaped here)."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def _reap(pid: int, end: float) -> None:
    """Wait (until `end` at the latest) for this process's child `pid` to end, and reap it."""
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done or time.monotonic() >= end:
            return
        time.sleep(0.002)
