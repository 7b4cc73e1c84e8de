"""Was it the out-of-memory killer? This process's cgroup counts the processes it killed.

cgroup v2 keeps the count as `oom_kill N` in `memory.events`, cgroup v1 in `memory.oom_control` of the memory
controller. The cgroup is the one /proc/self/cgroup names, found under the cgroup file system's mount point
from /proc/self/mountinfo. LEVERS9_CGROUP_DIR names the cgroup folder to read instead (tests point it at a
stand-in folder). A caller reads the count when a rank or job starts and again when it sees a SIGKILL: a
higher count means the kernel's OOM killer fired in this cgroup.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from levers9.errors import signal_name

CGROUP_DIR_VAR = "LEVERS9_CGROUP_DIR"
_COUNTER_FILES = ("memory.events", "memory.oom_control")  # v2, v1


def oom_kills() -> int | None:
    """How many processes the OOM killer has killed in this process's cgroup; None when unknown."""
    counts = (_read_count(folder / name) for folder in _cgroup_dirs() for name in _COUNTER_FILES)
    return next((count for count in counts if count is not None), None)


def killed_by(signum: int, before: int | None, after: int | None) -> str:
    """'killed by SIGKILL', given this cgroup's OOM-kill count when the process started and when its death
    was seen; the out-of-memory killer is named only when the count rose (no claim without evidence)."""
    how = f"killed by {signal_name(signum)}"
    if signum != signal.SIGKILL:
        return how
    if before is None or after is None:
        return (
            f"{how} (this cgroup's out-of-memory kill count could not be read; `dmesg` shows whether the "
            f"kernel's out-of-memory killer fired)"
        )
    if after > before:
        return (
            f"{how}; the out-of-memory killer fired in this cgroup (count {before} → {after}): "
            f"reduce batch size or give the job more memory"
        )
    return how


def _cgroup_dirs() -> list[Path]:
    """The cgroup folders to look in: LEVERS9_CGROUP_DIR alone when set, else this process's."""
    if override := os.environ.get(CGROUP_DIR_VAR):
        return [Path(override)]
    try:
        return cgroup_dirs(Path("/proc/self/cgroup").read_text(), Path("/proc/self/mountinfo").read_text())
    except OSError:
        return []


def cgroup_dirs(membership: str, mountinfo: str) -> list[Path]:
    """The memory cgroup folders of a process, from its /proc/<pid>/cgroup and mountinfo texts."""
    mounts = mountinfo.splitlines()
    found: list[Path] = []
    for line in membership.splitlines():  # "0::/path" (v2) or "4:memory:/path" (v1)
        if line.count(":") < 2:
            continue
        _, controllers, rel = line.split(":", 2)
        if controllers == "":
            found += _under_mounts(mounts, "cgroup2", None, rel)
        elif "memory" in controllers.split(","):
            found += _under_mounts(mounts, "cgroup", "memory", rel)
    return found


def _under_mounts(mounts: list[str], fstype: str, option: str | None, rel: str) -> list[Path]:
    """The folder of cgroup `rel` under each matching mount (mountinfo: root is field 4, mount point field 5)."""
    out = []
    for line in mounts:
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] != fstype:
            continue
        if option is not None and option not in tail[2].split(","):
            continue
        root, point = fields[3], fields[4]
        inner = rel[len(root) :] if root != "/" and rel.startswith(root) else rel
        out.append(Path(point) / inner.lstrip("/"))
    return out


def _read_count(path: Path) -> int | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None
