"""Functions that tests/test_faults_procs.py runs as ranks, jobs and callers' helpers (importable, so they fork and ship)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path


def pattern(size: int) -> bytes:
    """`size` bytes of printable text with no newline, different at every offset modulo 251."""
    unit = bytes(33 + (i * 7) % 90 for i in range(251))
    return (unit * (size // len(unit) + 1))[:size]


def long_line(size: int) -> None:
    """Print one line of `size` bytes (pattern(size)), then a short one."""
    sys.stdout.flush()
    os.write(1, pattern(size) + b"\n")
    print("after the long line", flush=True)


def numbered_line(i: int) -> str:
    return f"{i:06d} " + "x" * 1017


def numbered_lines(count: int) -> None:
    """Print `count` numbered 1 KB lines."""
    for i in range(count):
        print(numbered_line(i), flush=True)


def print_forever() -> None:
    """Print 1 KB lines until stopped."""
    line = "x" * 1023
    while True:
        print(line, flush=True)


def write_pid(path: str, pid: int) -> None:
    tmp = f"{path}.tmp"
    Path(tmp).write_text(str(pid))
    os.replace(tmp, path)


def wait_for(path: str, seconds: float = 20.0) -> int:
    """The pid written to `path`, once it is there."""
    end = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"{path} was not written within {seconds} s")
        time.sleep(0.02)
    return int(Path(path).read_text())


def start_daemon(pidfile: str) -> int:
    """Start a daemon the classic way (double fork, setsid, stdio on /dev/null) that sleeps for two
    minutes; its pid once it wrote it to `pidfile`."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            if os.fork() == 0:
                null = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(null, fd)
                write_pid(pidfile, os.getpid())
                time.sleep(120)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    return wait_for(pidfile)


def daemon_then_return(pidfile: str) -> int:
    """Start a daemon, and return its pid at once."""
    return start_daemon(pidfile)


def daemon_then_hang(pidfile: str) -> None:
    """Start a daemon, then sleep until stopped."""
    start_daemon(pidfile)
    time.sleep(600)


def grandchild_then_hang(folder: str) -> None:
    """Start `sleep 120` (in this process's group), write this pid and its pid to `folder`, sleep until stopped."""
    sleeper = subprocess.Popen(["sleep", "120"])
    write_pid(os.path.join(folder, "grandchild"), sleeper.pid)
    write_pid(os.path.join(folder, "job"), os.getpid())
    time.sleep(600)


def add(a: int, b: int) -> int:
    return a + b
