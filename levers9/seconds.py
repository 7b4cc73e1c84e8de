"""What levers9 accepts as a number of seconds, decided in one place for every argument and record that holds one
(`timeout=`, `stall_timeout=`, `stop_grace=`, `queue_timeout=`, `restart_delay=`, a run record's times); each
caller keeps its own message, since each names its own argument and fix; and how one is said in a table."""

from __future__ import annotations

import math
from typing import TypeGuard


def is_seconds(value: object, *, zero_ok: bool) -> TypeGuard[int | float]:
    """True for a finite int or float (never a bool) above 0, or at 0 too when `zero_ok`."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value >= 0 if zero_ok else value > 0)
    )


def say_duration(seconds: float, *, tenths: bool = False) -> str:
    """'42s', '3m07s' or '2h05m' (whole seconds, cut down); with `tenths`, under a minute as '4.2s'."""
    if seconds < 60:
        return f"{seconds:.1f}s" if tenths else f"{int(seconds)}s"
    whole = int(seconds)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
