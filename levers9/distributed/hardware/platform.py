"""The facts about this machine that quirk rows read besides the cards: WSL2, ROCm, /dev/shm, kernel command line."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import re
import sys


@dataclasses.dataclass(frozen=True)
class Platform:
    """The facts about this machine that rows read besides the cards (pass one to plan_quirks in tests)."""

    wsl: bool = False
    rocm: str | None = None  # the HIP version torch was built with
    shm_bytes: int | None = None  # size of /dev/shm; None if there is none
    kernel_cmdline: str | None = None
    docker: bool = False


def is_wsl() -> bool:
    """True under WSL (the kernel release names Microsoft)."""
    try:
        return "microsoft" in os.uname().release.lower()
    except AttributeError:
        return False


def rocm_version() -> str | None:
    """The HIP version torch was built with (torch.version.hip), read without importing torch."""
    torch = sys.modules.get("torch")
    if torch is not None:
        hip = getattr(getattr(torch, "version", None), "hip", None)
        return str(hip) if hip else None
    return _rocm_from_files()


@functools.lru_cache(maxsize=1)
def _rocm_from_files() -> str | None:
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        try:
            with open(os.path.join(folder, "version.py"), encoding="utf-8") as f:
                m = re.search(r"^hip\s*(?::[^=\n]*)?=\s*['\"]([^'\"]+)['\"]", f.read(), re.MULTILINE)
        except OSError:
            continue
        return m.group(1) if m else None
    return None


def shm_bytes(path: str = "/dev/shm") -> int | None:
    """Total size of the filesystem at `path` (/dev/shm), or None where there is none."""
    try:
        st = os.statvfs(path)
    except (OSError, AttributeError):
        return None
    return st.f_frsize * st.f_blocks


def kernel_cmdline() -> str | None:
    """/proc/cmdline, or None where it cannot be read."""
    try:
        with open("/proc/cmdline", encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def in_docker() -> bool:
    """True inside a Docker container (Docker creates /.dockerenv)."""
    return os.path.exists("/.dockerenv")


def read_platform() -> Platform:
    """Everything `Platform` holds, read from this machine."""
    return Platform(is_wsl(), rocm_version(), shm_bytes(), kernel_cmdline(), in_docker())
