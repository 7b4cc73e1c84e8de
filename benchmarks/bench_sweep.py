"""Sweep overhead: k cells on k cards should take about as long as one cell.

Each case is a whole Python process (interpreter start, `import torch`, levers9, the work), timed
from outside, so start-up costs count as a user would feel them:

    in place      one cell called directly: cell(0)
    map 4 on 4    list(cell.map(range(4))) on 4 simulated RTXPro6000 cards
    map 8 on 4    eight cells on four cards: two rounds
    map 4, exec   as "map 4 on 4", with jobs started as fresh interpreters (the path taken when
                  CUDA is already initialised in the caller)

Every cell sleeps CELL_SECONDS (2 s by default). Run:

    python benchmarks/bench_sweep.py [--repeat 3] [--seconds 2] [--no-torch]

`--scale 100,1000,10000` measures instead the cost per cell of no-op sweeps of those sizes on the
local executor and on a local Ray (4 simulated cards; Ray started and warmed up before the clock
starts), each size in a fresh process: whether the cost per cell stays flat as the sweep grows.

This is a benchmark, not a test: it prints a table and the ratios, and asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = """
import sys, time
if {torch}:
    import torch  # what a training script pays anyway, in every case alike
from levers9 import job

@job(gpu="RTXPro6000", gpu_count=1, stream_output=False)
def cell(i):
    time.sleep({seconds})
    return i

if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "inplace":
        assert cell(0) == 0
    else:
        n = int(mode)
        assert list(cell.map(range(n))) == list(range(n))
"""

SCALE_CHILD = """
import sys, time
from levers9 import job

backend, n = sys.argv[1], int(sys.argv[2])

@job(gpu="RTXPro6000", gpu_count=1, stream_output=False, backend=backend)
def cell(i):
    return i

if __name__ == "__main__":
    cell.remote(-1)  # warm-up: a local Ray starts here, outside the timing
    start = time.perf_counter()
    assert list(cell.map(range(n), progress=False)) == list(range(n))
    print(time.perf_counter() - start)
"""

CASES = [
    ("in place", "inplace", {}),
    ("map 4 on 4", "4", {}),
    ("map 8 on 4", "8", {}),
    ("map 4, spawn", "4", {"LEVERS9_START_METHOD": "spawn"}),
]


def main() -> None:
    """Time each case `--repeat` times and print medians and ratios to the in-place run."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--no-torch", action="store_true", help="do not import torch in the processes")
    parser.add_argument("--scale", help="comma-separated sweep sizes: cost per no-op cell, local vs Ray")
    args = parser.parse_args()
    if args.scale:
        scale([int(n) for n in args.scale.split(",")])
        return
    with tempfile.TemporaryDirectory(prefix="levers9-bench-") as tmp:
        script = os.path.join(tmp, "sweep.py")
        with open(script, "w") as handle:
            handle.write(CHILD.format(torch=not args.no_torch, seconds=args.seconds))
        base_env = {
            **os.environ,
            "LEVERS9_SIMULATE_GPUS": "RTXPro6000:4",
            "LEVERS9_CONFIG_DIR": os.path.join(tmp, "config"),
            "LEVERS9_STATE_DIR": os.path.join(tmp, "state"),
        }
        results: dict[str, list[float]] = {name: [] for name, _, _ in CASES}
        for _ in range(args.repeat):
            for name, mode, extra in CASES:  # interleaved, so drift in machine load hits every case alike
                start = time.perf_counter()
                subprocess.run([sys.executable, script, mode], env={**base_env, **extra}, check=True)
                results[name].append(time.perf_counter() - start)
    base = statistics.median(results["in place"])
    print(f"cells sleep {args.seconds:g} s; whole-process wall clock, median of {args.repeat}; "
          f"torch imported: {not args.no_torch}; python {sys.version.split()[0]}, {os.cpu_count()} CPUs")  # fmt: skip
    print(f"{'case':<14}{'median s':>10}{'min s':>9}{'max s':>9}{'ratio':>8}")
    for name, times in results.items():
        med = statistics.median(times)
        print(f"{name:<14}{med:>10.2f}{min(times):>9.2f}{max(times):>9.2f}{med / base:>7.3f}x")


def scale(sizes: list[int]) -> None:
    """Print the cost per no-op cell for each sweep size on each backend."""
    print(f"no-op cells on 4 simulated cards; ms per cell (map wall time / cells); "
          f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs")  # fmt: skip
    print(f"{'cells':>7}{'local':>10}{'ray':>10}")
    with tempfile.TemporaryDirectory(prefix="levers9-bench-") as tmp:
        script = os.path.join(tmp, "scale.py")
        with open(script, "w") as handle:
            handle.write(SCALE_CHILD)
        env = {
            **os.environ,
            "LEVERS9_SIMULATE_GPUS": "RTXPro6000:4",
            "LEVERS9_CONFIG_DIR": os.path.join(tmp, "config"),
            "LEVERS9_STATE_DIR": os.path.join(tmp, "state"),
        }
        cost: dict[tuple[str, int], float] = {}
        for backend in ("local", "ray"):  # every local size first: a Ray that just shut down still loads the machine
            for n in sizes:
                done = subprocess.run([sys.executable, script, backend, str(n)], env=env, capture_output=True, text=True)
                if done.returncode != 0:
                    sys.exit(f"{backend} sweep of {n} cells failed (exit {done.returncode}):\n{done.stderr}")
                cost[backend, n] = float(done.stdout.split()[-1]) / n * 1000
        for n in sizes:
            print(f"{n:>7}{cost['local', n]:>10.1f}{cost['ray', n]:>10.1f}")


if __name__ == "__main__":
    main()
