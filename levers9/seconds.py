"""What levers9 accepts as a number of seconds, decided in one place for every argument and record that holds one
(`timeout=`, `stall_timeout=`, `stop_grace=`, `queue_timeout=`, `restart_delay=`, a run record's times); each
caller keeps its own message, since each names its own argument and fix."""

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
