"""torch.compile inside 2 ranks: a training script that compiles its model, under torchrun and `levers9 run`.

    python benchmarks/bench_compile.py --repeats 3 [--before /tmp/before]

compile_job.py compiles a small DDP model with inductor and trains 20 steps on 2 gloo ranks; each launcher
starts the whole job as a fresh process, interleaved round by round, with an inductor cache of its own per
run (every run compiles). `--before DIR` adds `levers9 run` with the levers9 of another checkout (the code
before a change). Forked ranks inherit the caller's imports, but inductor's compile workers and the C++
compiler run in every rank either way, so this is the launch benchmark's pair where the work is heaviest.
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

HERE = Path(__file__).resolve().parent
JOB = str(HERE / "compile_job.py")
BIN = Path(sys.executable).parent
TORCHRUN = str(BIN / "torchrun") if (BIN / "torchrun").exists() else "torchrun"
REPO = str(HERE.parent)


def time_once(cmd: list[str], tree: str) -> float | None:
    """Wall seconds of one whole run; None (with the end of its stderr printed) when it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": tree, "TMPDIR": tmp, "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "inductor")}
        start = time.perf_counter()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        elapsed = time.perf_counter() - start
    if done.returncode != 0:
        print(f"failed (exit {done.returncode}): {' '.join(cmd)}\n{done.stderr[-1500:]}", file=sys.stderr)
        return None
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--before", help="a checkout of the code before a change, for a `levers9 run, before` row")
    args = parser.parse_args()
    levers9_run = [sys.executable, "-m", "levers9", "run", "--nproc-per-node", "2", JOB]
    contenders = {"levers9 run": (levers9_run, REPO), "torchrun": ([TORCHRUN, "--standalone", "--nproc-per-node", "2", JOB], REPO)}
    if args.before:
        contenders["levers9 run, before"] = (levers9_run, args.before)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    failed = dict.fromkeys(contenders, 0)
    for _ in range(args.repeats):
        for name, (cmd, tree) in contenders.items():
            elapsed = time_once(cmd, tree)
            if elapsed is None:
                failed[name] += 1
            else:
                times[name].append(elapsed)
    base = statistics.median(times["torchrun"]) if times["torchrun"] else float("nan")
    print(f"2 ranks, torch.compile of a small DDP model, 20 steps, gloo on CPU; {args.repeats} runs each, interleaved")
    print("\n| launcher | median wall time (s) | fastest (s) | vs torchrun | failed runs |\n| --- | --- | --- | --- | --- |")
    for name, values in times.items():
        median = statistics.median(values) if values else float("nan")
        fastest = min(values) if values else float("nan")
        print(f"| {name} | {median:.2f} | {fastest:.2f} | {median / base:.2f}x | {failed[name]} |")


if __name__ == "__main__":
    main()
