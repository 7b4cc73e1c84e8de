"""Parent side: the cgroup's out-of-memory-kill counter, read before a run and after a crash, so a child
killed by SIGKILL can be named: the kernel's OOM killer, or something else.

cgroup v2 keeps the count in `memory.events` (`oom_kill N`), v1 in `memory.oom_control` (`oom_kill N`),
in this process's cgroup folder (found through /proc/self/cgroup and /proc/self/mountinfo). Children
are in the same cgroup unless something moved them. `LEVERS9_CGROUP_DIR` points at another folder
holding either file (tests use a stand-in folder).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

CGROUP_DIR_VAR = "LEVERS9_CGROUP_DIR"


def cgroup_dir() -> Path | None:
    """The folder of this process's memory cgroup, or None where none can be found."""
    override = os.environ.get(CGROUP_DIR_VAR)
    if override:
        return Path(override)
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: one unified hierarchy
            root = _mount_point("cgroup2", None)
        elif "memory" in controllers.split(","):
            root = _mount_point("cgroup", "memory")
        else:
            continue
        if root is not None:
            return root / path.lstrip("/")
    return None


def _mount_point(fstype: str, option: str | None) -> Path | None:
    """Where a cgroup filesystem of `fstype` (with `option` among its super options) is mounted."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        before, _, after = line.partition(" - ")
        fields, rest = before.split(), after.split()
        if len(fields) >= 5 and rest and rest[0] == fstype and (option is None or option in rest[-1].split(",")):
            return Path(fields[4])
    return None


def oom_kills(folder: Path | None = None) -> int | None:
    """How many processes the OOM killer has killed in this cgroup so far; None where that cannot be read."""
    folder = folder or cgroup_dir()
    if folder is None:
        return None
    for name in ("memory.events", "memory.oom_control"):
        try:
            text = (folder / name).read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    return None


def crash_hint(signum: int | None, before: int | None, after: int | None) -> str:
    """A sentence to add to a crash report: whether a SIGKILL was the out-of-memory killer ('' otherwise)."""
    if signum != signal.SIGKILL:
        return ""
    if before is not None and after is not None:
        if after > before:
            return (
                f" Killed by SIGKILL; the out-of-memory killer fired in this cgroup (count {before} → {after}): "
                f"reduce the batch size or give the job more memory."
            )
        return f" The out-of-memory killer did not fire in this cgroup (count {after}): something else sent SIGKILL."
    return " SIGKILL with no one asking is usually the kernel's out-of-memory killer: check `dmesg`, or reduce the batch size."
