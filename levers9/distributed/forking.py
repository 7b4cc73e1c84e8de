"""Whether this process may fork children that will use CUDA, and process-lifetime helpers for children.

Forking is the fastest way to start ranks and jobs (no interpreter start, no second `import torch`),
but a child forked after the CUDA driver was initialised cannot use CUDA ("Cannot re-initialize CUDA
in forked subprocess"). The driver library being mapped into this process is the sign that it was.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys


def fork_is_safe() -> tuple[bool, str]:
    """(True, "") if children forked now can use CUDA, else (False, the reason)."""
    if sys.platform != "linux":
        return False, f"fork is only used on Linux (this is {sys.platform})"
    torch = sys.modules.get("torch")
    if torch is not None:
        cuda = getattr(torch, "cuda", None)
        if cuda is not None and cuda.is_initialized():
            return False, "CUDA is already initialised in this process"
    if _cuda_driver_loaded():
        return False, "the CUDA driver (libcuda) is already loaded in this process"
    return True, ""


def _cuda_driver_loaded() -> bool:
    """True if libcuda.so is mapped into this process (someone called into the CUDA driver)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            return any("libcuda.so" in line for line in maps)
    except OSError:
        return False


_PR_SET_PDEATHSIG = 1


def die_with_parent(expected_parent: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent exits (Linux); exit now if it already has."""
    if sys.platform == "linux":
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != expected_parent:  # the parent died before prctl took effect
        os._exit(1)
