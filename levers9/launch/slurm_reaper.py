"""Cancels a caller's SLURM jobs when the caller dies without cancelling them itself (SIGKILL, a SIGTERM
that ends Python without its clean-up): a small process of its own session, reading job ids from a pipe.

The caller writes "+ID" when it submits a job and "-ID" when the job is over; when the pipe closes (the
caller ended, however it ended), whatever is still listed is cancelled with scancel, then this exits.
Run as a script (`python slurm_reaper.py`), so it imports nothing of levers9's.
"""

from __future__ import annotations

import signal
import subprocess
import sys


def main() -> None:
    """Follow stdin's +ID / -ID lines; at its end, scancel the ids still listed."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the caller's terminal is the caller's to handle
    live: set[str] = set()
    for line in sys.stdin:
        word = line.strip()
        if word.startswith("+"):
            live.add(word[1:])
        elif word.startswith("-"):
            live.discard(word[1:])
    if live:
        subprocess.run(["scancel", *sorted(live)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)


if __name__ == "__main__":
    main()
