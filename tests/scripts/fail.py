"""Rank 1 fails in the way argv[1] names (raise, exit3, kill9, segv) or exits 0 early (early0); rank 0 waits a little."""

import os
import signal
import sys
import time

rank = int(os.environ["RANK"])
mode = sys.argv[1]
if rank == 1:
    if mode == "raise":
        raise ValueError("rank 1 could not read its shard")
    if mode == "exit3":
        sys.exit(3)
    if mode == "kill9":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if mode == "early0":
        sys.exit(0)
if mode == "early0":
    time.sleep(1.0)  # outlives rank 1, which left with status 0
    print("rank 0 finished after rank 1 left", flush=True)
else:
    time.sleep(60)  # stopped by levers9 when rank 1 fails
