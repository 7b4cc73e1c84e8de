"""Launch cost: a 2-rank job (join a group, one all_reduce, return) under each launcher, same run.

    python benchmarks/bench_launch.py --repeats 5
    python benchmarks/bench_launch.py --repeats 3 --long-line-mb 100   # rank 0 also prints one 100 MB line
    python benchmarks/bench_launch.py --repeats 9 --only anchor,distributed.run   # against the anchor alone

Each launcher starts the whole job as a fresh process (`python ...`, `levers9 run ...`, `torchrun ...`,
`accelerate launch ...`), interleaved round by round so machine noise hits all of them alike; the table gives
the median and the fastest whole-process wall time, and each one's ratio to torchrun's median; then the median
CPU time (user + system, of the process and every process it waited for) and each one's wall and CPU time
against the anchor's, a hand-written 2-rank job with nothing a launcher does (launch_anchor.py), and against
the same anchor paying the garbage collection `import torch` leaves due, which the first few thousand objects
any other code makes set off (launch_anchor.py --collect). With
--long-line-mb, rank 0 also prints one line that long (the benchmark reads it all and checks its length),
accelerate and the anchor are left out, and the table adds the launcher's peak memory (the largest RSS of any of its processes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from precompiled import precompile

HERE = Path(__file__).resolve().parent
JOB = str(HERE / "launch_job.py")
ANCHOR = str(HERE / "launch_anchor.py")
BIN = Path(sys.executable).parent
ANCHOR_ROW = "hand-written anchor (one import torch, two forks, a TCPStore)"
COLLECTED_ANCHOR_ROW = "hand-written anchor + the collection torch's import leaves due"


def tool(name: str) -> str:
    return str(BIN / name) if (BIN / name).exists() else name


LAUNCHERS = {
    ANCHOR_ROW: [sys.executable, ANCHOR],
    COLLECTED_ANCHOR_ROW: [sys.executable, ANCHOR, "--collect"],
    "levers9 distributed.run": [sys.executable, JOB, "levers9"],
    "levers9 run": [sys.executable, "-m", "levers9", "run", "--nproc-per-node", "2", JOB, "plain"],
    "torchrun": [tool("torchrun"), "--nproc-per-node", "2", JOB, "plain"],
    "torch.multiprocessing.spawn": [sys.executable, JOB, "mp-spawn"],
    "accelerate launch": [tool("accelerate"), "launch", "--multi_gpu", "--num_processes", "2", JOB, "plain"],
}


# Runs argv[2:] and writes the largest RSS (KiB) of it and its descendants, and their CPU seconds, to argv[1].
PEAK_RSS = (
    "import resource, subprocess, sys; code = subprocess.call(sys.argv[2:]); "
    "u = resource.getrusage(resource.RUSAGE_CHILDREN); "
    "open(sys.argv[1], 'w').write(f'{u.ru_maxrss} {u.ru_utime + u.ru_stime}'); sys.exit(code)"
)


def time_once(cmd: list[str], line_bytes: int = 0) -> tuple[float, float, float]:
    """Wall seconds of one whole run, its peak RSS in MiB, and its CPU seconds."""
    with tempfile.TemporaryDirectory() as tmp:  # torchrun's agent leaves torchelastic_* folders in $TMPDIR
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": tmp, "LAUNCH_JOB_LINE_BYTES": str(line_bytes)}
        rss_file = os.path.join(tmp, "rss")
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", PEAK_RSS, rss_file, *cmd], env=env, capture_output=True)
        elapsed = time.perf_counter() - start
        rss, cpu = open(rss_file).read().split() if os.path.exists(rss_file) else ("nan", "nan")
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout[-4000:]!r}\n{done.stderr[-4000:]!r}")
    if line_bytes and b"x" * line_bytes + b"\n" not in done.stdout:
        longest = max(map(len, done.stdout.split(b"\n")))
        raise SystemExit(f"{' '.join(cmd)}: expected one {line_bytes}-byte line on stdout, the longest was {longest}")
    return elapsed, float(rss) / 1024, float(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--long-line-mb", type=float, default=0, help="rank 0 also prints one line this long")
    parser.add_argument("--json", help="also write every time measured to this file")
    parser.add_argument("--only", help="comma-separated words: run only the launchers whose name holds one")
    args = parser.parse_args()
    line_bytes = int(args.long_line_mb * 1_000_000)
    launchers = {k: v for k, v in LAUNCHERS.items()
                 if not (line_bytes and (k == "accelerate launch" or k.startswith("hand-written")))}  # fmt: skip
    if args.only:
        launchers = {k: v for k, v in launchers.items() if any(word in k for word in args.only.split(","))}
    times: dict[str, list[float]] = {name: [] for name in launchers}
    peaks: dict[str, list[float]] = {name: [] for name in launchers}
    cpus: dict[str, list[float]] = {name: [] for name in launchers}
    precompile(HERE.parent)  # levers9 as installed: its bytecode compiled, as torch's is
    for cmd in launchers.values():  # warm the page cache once, untimed
        time_once(cmd)
    for _ in range(args.repeats):
        for name, cmd in launchers.items():
            elapsed, rss, cpu = time_once(cmd, line_bytes)
            times[name].append(elapsed)
            peaks[name].append(rss)
            cpus[name].append(cpu)
    base = statistics.median(times["torchrun"]) if "torchrun" in times else float("nan")

    def medians(name: str) -> tuple[float, float]:
        """The median wall and CPU time of a row that ran, else NaNs."""
        return (statistics.median(times[name]), statistics.median(cpus[name])) if name in times else (math.nan, math.nan)

    wall0, cpu0 = medians(ANCHOR_ROW)
    wall1, cpu1 = medians(COLLECTED_ANCHOR_ROW)
    what = f"rank 0 prints one {args.long_line_mb:g} MB line" if line_bytes else "one all_reduce"
    print(f"2-rank job, {what}, gloo on CPU; {args.repeats} runs each, interleaved; "
          f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print()
    print("| launcher | median wall time (s) | fastest (s) | vs torchrun | peak RSS (MiB) | median CPU time (s) "
          "| wall vs anchor | CPU vs anchor | wall vs anchor + collection | CPU vs anchor + collection |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, values in times.items():
        med, cpu = statistics.median(values), statistics.median(cpus[name])
        print(f"| {name} | {med:.2f} | {min(values):.2f} | {med / base:.2f}x | {max(peaks[name]):.0f} | {cpu:.2f} "
              f"| {med / wall0:.2f}x | {cpu / cpu0:.2f}x | {med / wall1:.2f}x | {cpu / cpu1:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"times": times, "cpu": cpus, "peak_rss_mib": peaks, "line_bytes": line_bytes}, f, indent=1)


if __name__ == "__main__":
    main()
