"""Launch cost of this checkout against another one (the code before a change), side by side with torchrun.

    git worktree add /tmp/before <commit>
    python benchmarks/bench_against.py /tmp/before --repeats 5

The 2-rank job of bench_launch.py runs under `distributed.run` and `levers9 run` with each checkout's levers9
(put first on PYTHONPATH), and under torchrun, interleaved round by round so machine noise hits all alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from precompiled import precompile

HERE = Path(__file__).resolve().parent
JOB = str(HERE / "launch_job.py")


def time_once(tree: str, cmd: list[str]) -> float:
    with tempfile.TemporaryDirectory() as tmp:  # torchrun's agent leaves torchelastic_* folders in $TMPDIR
        env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1", "TMPDIR": tmp}
        start = time.perf_counter()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} (PYTHONPATH={tree}) failed:\n{done.stderr[-3000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", help="a checkout of the code to compare against (e.g. a git worktree)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    here = str(HERE.parent)
    run = [sys.executable, JOB, "levers9"]
    cli = [sys.executable, "-m", "levers9", "run", "--nproc-per-node", "2", JOB, "plain"]
    cases = {
        "distributed.run, this checkout": (here, run),
        "distributed.run, before": (args.before, run),
        "levers9 run, this checkout": (here, cli),
        "levers9 run, before": (args.before, cli),
        "torchrun": (here, [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", JOB, "plain"]),
    }
    for tree in (HERE.parent, Path(args.before)):  # both as installed: bytecode compiled, as torch's is
        precompile(tree)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for round_number in range(args.repeats + 1):  # the first round warms the page cache, untimed
        for name, (tree, cmd) in cases.items():
            elapsed = time_once(tree, cmd)
            if round_number:
                times[name].append(elapsed)
    base = statistics.median(times["torchrun"])
    print(f"2-rank job, one all_reduce, gloo on CPU; {args.repeats} runs each, interleaved; {os.cpu_count()} cores")
    print()
    print("| launcher | median wall time (s) | fastest (s) | vs torchrun |")
    print("| --- | --- | --- | --- |")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.2f} | {min(values):.2f} | {statistics.median(values) / base:.2f}x |")


if __name__ == "__main__":
    main()
