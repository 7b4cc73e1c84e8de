"""Launch cost: a 2-rank job (join a group, one all_reduce, return) under each launcher, same run.

    python benchmarks/bench_launch.py --repeats 5

Each launcher starts the whole job as a fresh process (`python ...`, `levers9 run ...`, `torchrun ...`,
`accelerate launch ...`), interleaved round by round so machine noise hits all of them alike; the table gives
the median and the fastest whole-process wall time, and each one's ratio to torchrun's median.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
JOB = str(HERE / "launch_job.py")
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    return str(BIN / name) if (BIN / name).exists() else name


LAUNCHERS = {
    "levers9 distributed.run": [sys.executable, JOB, "levers9"],
    "levers9 run": [sys.executable, "-m", "levers9", "run", "--nproc-per-node", "2", JOB, "plain"],
    "torchrun": [tool("torchrun"), "--nproc-per-node", "2", JOB, "plain"],
    "torch.multiprocessing.spawn": [sys.executable, JOB, "mp-spawn"],
    "accelerate launch": [tool("accelerate"), "launch", "--multi_gpu", "--num_processes", "2", JOB, "plain"],
}


def time_once(cmd: list[str]) -> float:
    with tempfile.TemporaryDirectory() as tmp:  # torchrun's agent leaves torchelastic_* folders in $TMPDIR
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": tmp}
        start = time.perf_counter()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in LAUNCHERS}
    for cmd in LAUNCHERS.values():  # warm the page cache once, untimed
        time_once(cmd)
    for _ in range(args.repeats):
        for name, cmd in LAUNCHERS.items():
            times[name].append(time_once(cmd))
    base = statistics.median(times["torchrun"])
    print(f"2-rank job, one all_reduce, gloo on CPU; {args.repeats} runs each, interleaved; "
          f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print()
    print("| launcher | median wall time (s) | fastest (s) | vs torchrun |")
    print("| --- | --- | --- | --- |")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"| {name} | {med:.2f} | {min(values):.2f} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
