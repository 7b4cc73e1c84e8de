"""Stops a caller's SLURM jobs with the job's stop_grace: the caller's cancels, and at the caller's death
(SIGKILL, a SIGTERM that ends Python without its clean-up) the jobs it did not see end. A small process of
its own session, reading lines from a pipe, so a stop outlives the caller that asked for it.

    python reaper.py GRACE     # GRACE: seconds between a job's SIGTERM and its kill (@job(stop_grace=))

The caller writes "+ID" when it submits a job, "-ID" when the job is over, and "!ID" to stop it now. A stop
is `scancel --state=PENDING ID` (what has not started never will: a pending element of a job array would
otherwise start on the cards the stopped ones free during their grace), `scancel --signal=TERM ID` (every
task of the job's steps gets SIGTERM: the user's handler can save), then
after GRACE seconds `scancel ID` (SLURM's own SIGTERM, KillWait, SIGKILL) if squeue still shows it running. When the
pipe closes (the caller ended, however it ended), every job still listed is stopped the same way; this
process exits once the last stop is done. Run as a script, so it imports nothing of levers9's.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

POLL_S = 0.5  # how often a stopped job is looked for in squeue during its grace
# slurm_collect.ENDED, copied: this script imports nothing of levers9's (tests/test_slurm_plan.py holds them equal)
ENDED = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED", "REVOKED", "SPECIAL_EXIT"}  # fmt: skip


def scancel(*args: str) -> None:
    subprocess.run(["scancel", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)


def active(job_ids: list[str]) -> bool:
    """Whether SLURM still runs or queues any of the jobs (False when squeue no longer knows them)."""
    try:
        done = subprocess.run(["squeue", "-h", "-r", "-t", "all", "-j", ",".join(job_ids), "-o", "%T"],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return True
    return done.returncode == 0 and any(state not in ENDED for state in done.stdout.split())


def kill_after(job_ids: list[str], grace: float) -> None:
    """`scancel` the jobs once `grace` s passed, unless they ended before (looked at every POLL_S)."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
        if not active(job_ids):
            return
    scancel(*job_ids)


def stop(job_ids: list[str], grace: float) -> threading.Thread | None:
    """The jobs (or array elements) still pending cancelled now, SIGTERM to the running ones' tasks, the kill
    after `grace` s (all at once when grace is 0); the thread that kills, which the process waits for before it
    exits."""
    if not job_ids:
        return None
    if grace <= 0:
        scancel(*job_ids)
        return None
    scancel("--state=PENDING", *job_ids)  # first: one that starts after this is running, and gets the SIGTERM
    scancel("--signal=TERM", *job_ids)
    killer = threading.Thread(target=kill_after, args=(job_ids, grace))
    killer.start()
    return killer


def main() -> None:
    """Follow stdin's +ID / -ID / !ID lines; at its end, stop the ids still listed."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the caller's terminal is the caller's to handle
    grace = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
    live: set[str] = set()
    killers: list[threading.Thread | None] = []
    for line in sys.stdin:
        word = line.strip()
        if word.startswith("+"):
            live.add(word[1:])
        elif word.startswith("-"):
            live.discard(word[1:])
        elif word.startswith("!"):
            live.discard(word[1:])
            killers.append(stop([word[1:]], grace))
    killers.append(stop(sorted(live), grace))
    for killer in killers:
        if killer is not None:
            killer.join()


if __name__ == "__main__":
    main()
