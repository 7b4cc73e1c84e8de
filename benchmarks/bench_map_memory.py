"""The caller's peak memory while it reads a long map, each result dropped once read.

Each contender maps CELLS cells (10,000 by default) of a function that returns SIZE bytes (40 KB by
default) and reads the results one by one, keeping none, in a fresh Python process of its own:

    levers9 map                 for r in cell.map(range(n), progress=False)   (CPU job, local backend)
    levers9 map, completed      the same with order="completed"
    ProcessPoolExecutor.map     concurrent.futures, os.cpu_count() workers
    Pool.imap                   multiprocessing, os.cpu_count() workers

Each process reports its resident memory (RSS) once warm (imports done, a few cells run), and its peak
RSS while the map ran (VmHWM, reset by /proc/self/clear_refs just before the map). Results held until the
end would show as CELLS x SIZE (400 MB by default); results let go once read, as a few MB.

    python benchmarks/bench_map_memory.py [--cells 10000] [--size 40000] [--before TREE] [--only NAME ...]

--before TREE also runs the levers9 rows with the levers9 of another checkout (PYTHONPATH=TREE), side by
side. levers9's run folder (which stores every result for resume, CELLS x SIZE on disk) goes to a
temporary LEVERS9_STATE_DIR, removed afterwards. This is a benchmark, not a test: it prints a table and
asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = """
import json, os, sys, time

def rss_kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)

def result(i, size={size}):
    return bytes(size)

def read_all(results):
    count = 0
    for value in results:
        value = value.value if type(value).__name__ == "Completed" else value  # levers9, order="completed"
        assert len(value) == {size}
        count += 1
        del value
    return count

if __name__ == "__main__":
    contender, n = sys.argv[1], int(sys.argv[2])
    if contender.startswith("levers9"):
        from levers9 import job
        cell = job(stream_output=False)(result)
        order = "completed" if contender.endswith("completed") else "input"
        run = lambda cells: read_all(cell.map(cells, order=order, progress=False))
    elif contender == "ProcessPoolExecutor.map":
        from concurrent.futures import ProcessPoolExecutor
        pool = ProcessPoolExecutor(os.cpu_count())
        run = lambda cells: read_all(pool.map(result, cells))
    else:
        import multiprocessing
        pool = multiprocessing.Pool(os.cpu_count())
        run = lambda cells: read_all(pool.imap(result, cells))
    run(range(8))  # warm: imports, workers, the first results
    warm = rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # VmHWM := VmRSS now
    started = time.perf_counter()
    assert run(range(n)) == n
    seconds = time.perf_counter() - started
    print(json.dumps({{"warm": warm, "peak": rss_kib("VmHWM"), "seconds": seconds}}))
"""

CONTENDERS = ["ProcessPoolExecutor.map", "Pool.imap", "levers9 map", "levers9 map, completed"]


def main() -> None:
    """Run each contender once in a fresh process and print its warm and peak RSS side by side."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", type=int, default=10_000)
    parser.add_argument("--size", type=int, default=40_000, help="bytes each cell returns")
    parser.add_argument("--before", help="a checkout of levers9 before a change: its levers9 rows side by side")
    parser.add_argument("--only", action="append", choices=CONTENDERS, help="run this contender (repeatable; default: all)")
    args = parser.parse_args()
    print(f"{args.cells} cells of {args.size} bytes, each result dropped once read; python {sys.version.split()[0]}, "
          f"{os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}")  # fmt: skip
    print(f"{'contender':<32}{'warm MB':>9}{'peak MB':>9}{'grew MB':>9}{'map s':>8}", flush=True)
    with tempfile.TemporaryDirectory(prefix="levers9-bench-") as tmp:
        script = Path(tmp) / "map_memory.py"
        script.write_text(CHILD.format(size=args.size))
        trees = [("", str(HERE.parent))] + ([(", before", args.before)] if args.before else [])
        runs = [(name + label, name, tree) for name in args.only or CONTENDERS for label, tree in trees
                if name.startswith("levers9") or not label]  # fmt: skip
        for number, (title, contender, tree) in enumerate(runs):  # each row as it comes: a 10,000-cell map is long
            state = os.path.join(tmp, f"state-{number}")
            env = {**os.environ, "PYTHONPATH": tree, "LEVERS9_CONFIG_DIR": os.path.join(tmp, "config"),
                   "LEVERS9_STATE_DIR": state}  # fmt: skip
            env.pop("LEVERS9_SIMULATE_GPUS", None)
            done = subprocess.run([sys.executable, str(script), contender, str(args.cells)], env=env,
                                  capture_output=True, text=True)  # fmt: skip
            if done.returncode != 0:
                sys.exit(f"{title} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
            got = json.loads(done.stdout.strip().splitlines()[-1])
            shutil.rmtree(state, ignore_errors=True)
            warm, peak = got["warm"] / 1024, got["peak"] / 1024
            print(f"{title:<32}{warm:>9.1f}{peak:>9.1f}{peak - warm:>9.1f}{got['seconds']:>8.1f}", flush=True)


if __name__ == "__main__":
    main()
