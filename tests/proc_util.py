"""Reading the process table from /proc (and the board folders), to prove that nothing was left running."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import levers9
from levers9.distributed.stalls.board import BOARD_DIR_PREFIX, board_roots

# The first line of a script a test sends Ctrl-C to: Python turns SIGINT into KeyboardInterrupt only when the
# process did not inherit it ignored, and a background shell's job or a pytest-xdist worker passes it on ignored.
CTRL_C_HANDLER = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"


def sigint_to_a_thread_that_is_not_main(pid: int) -> None:
    """What the kernel may do with a Ctrl-C: hand the process's SIGINT to any thread not blocking it."""
    others = [int(tid) for tid in os.listdir(f"/proc/{pid}/task") if int(tid) != pid]
    assert others, "the process has no thread besides its main one"
    libc = ctypes.CDLL(None, use_errno=True)
    # tgkill(2), glibc 2.30+: to that one thread; the newest first, one that ended since the listing (an output
    # thread idles out) skipped
    assert any(libc.tgkill(pid, tid, signal.SIGINT) == 0 for tid in reversed(others)), (
        "no thread besides the main one took the signal")


def _processes() -> Iterator[tuple[int, list[str]]]:
    """(pid, the fields of /proc/<pid>/stat after the name: state, ppid, pgrp, ...) for every process now."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:  # it ended meanwhile
                continue
            yield int(entry), stat.rsplit(")", 1)[1].split()


def children_of(pid: int) -> list[int]:
    """Live (non-zombie) processes whose parent is `pid`."""
    return [child for child, fields in _processes() if int(fields[1]) == pid and fields[0] != "Z"]


def in_group(pgid: int) -> list[int]:
    """The processes (zombies too) in process group `pgid`."""
    return [member for member, fields in _processes() if int(fields[2]) == pgid]


def alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], seconds: float = 5.0) -> list[int]:
    """The pids among `pids` still alive after waiting up to `seconds`."""
    end = time.monotonic() + seconds
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < end:
        time.sleep(0.05)
        left = [p for p in left if alive(p)]
    return left


def left_behind(before: set[int], seconds: float = 5.0) -> list[int]:
    """Children of this process that were not there in `before` and are still alive after `seconds`.

    Comparing with a snapshot keeps long-lived helpers of the test session (a shared Ray, say) out
    of the answer, so only what the test itself started counts.
    """
    return wait_gone([p for p in children_of(os.getpid()) if p not in before], seconds)


def free_port() -> int:
    """A loopback port nothing listens on now (for a launcher that must be told one, as torchrun's --master-port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def is_torch_chatter(line: str | bytes) -> bool:
    """A line torch itself prints on some releases, whoever launched it (torch 2.8's gloo prints
    '[Gloo] Rank 0 is connected to 1 peer ranks. ...' once per group), so tests that count lines skip it."""
    return ("[Gloo] Rank " if isinstance(line, str) else b"[Gloo] Rank ") in line  # type: ignore[operator]


def board_folders_of(pid: int) -> list[Path]:
    """The board folders of runs whose caller is `pid`, at every place a board folder goes (looking makes none)."""
    return [folder for root in board_roots() for folder in root.glob(f"{BOARD_DIR_PREFIX}{pid}-*")]


SHM_BOARDS = Path(f"/dev/shm/levers9-{os.getuid()}")  # where boards go when no state folder is set


def remove_shm_boards_if_empty() -> None:
    """Remove /dev/shm/levers9-<uid> once it is empty, so tests that sent a board there leave the machine as
    it was, whichever of them (in several pytest workers) ends last."""
    with contextlib.suppress(OSError):  # not there, or another test's board is in it now
        SHM_BOARDS.rmdir()


def levers9_frames(printed: str) -> list[str]:
    """The traceback lines of `printed` ('  File "...", line N, in f') in a file of the levers9 package itself, by its
    folder: a checkout in a folder named levers9 (what `git clone` makes) has '/levers9/' in every test's path too."""
    package = str(Path(levers9.__file__).parent) + os.sep
    return [line for line in printed.splitlines() if line.startswith(f'  File "{package}')]
