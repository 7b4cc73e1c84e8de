"""A 2-node start: `levers9 run --nnodes 2` against `torchrun --nnodes 2`, two launchers on this machine.

    PYTHONPATH=$PWD python benchmarks/bench_nodes.py [--repeat 5]

Each case starts node 0's and node 1's launcher at once (2 gloo ranks each, loopback master) on
tests/scripts/node_ranks.py, which makes its group, all_reduces rank+1 across the 4 ranks and ends; the time is
from starting both launchers to both having exited 0. Static (`--node-rank 0|1 --master-addr --master-port`) and
c10d (`--rdzv-endpoint`, the same command on both) for each launcher, interleaved, medians printed. A benchmark, not
a test: it prints a table and asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = str(REPO / "tests" / "scripts" / "node_ranks.py")
LAUNCHERS = {"levers9 run": [sys.executable, "-m", "levers9", "run"], "torchrun": [sys.executable, "-m", "torch.distributed.run"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def options(form: str, node: int, port: int) -> list[str]:
    if form == "static":
        return ["--nnodes", "2", "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port)]
    return ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench"]


def two_nodes(launcher: list[str], form: str) -> float:
    """Seconds from starting both launchers to both having exited (0, else it raises)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(PYTHONPATH=str(REPO), LEVERS9_GANG_SECRET=secrets.token_hex(16))
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:  # torchrun's agent leaves torchelastic_* folders in $TMPDIR
        started = time.perf_counter()
        processes = [subprocess.Popen([*launcher, *options(form, i, port), "--nproc-per-node", "2", SCRIPT],
                                      env={**env, "TMPDIR": tmp}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                     for i in (0, 1)]  # fmt: skip
        errors = [p.communicate(timeout=300)[1] for p in processes]
        took = time.perf_counter() - started
    if any(p.returncode for p in processes):
        raise SystemExit(f"{launcher} {form} failed: {[p.returncode for p in processes]}\n{errors[0][-2000:]!r}")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    cases: dict[tuple[str, str], Callable[[], float]] = {
        (name, form): (lambda launcher=launcher, form=form: two_nodes(launcher, form))
        for form in ("static", "c10d") for name, launcher in LAUNCHERS.items()
    }  # fmt: skip
    times: dict[tuple[str, str], list[float]] = {case: [] for case in cases}
    for run in cases.values():  # one round first, untimed: the page cache holds torch for every case
        run()
    for _ in range(args.repeat):
        for case, run in cases.items():
            times[case].append(run())
    print(f"2 nodes x 2 gloo ranks on this machine, median of {args.repeat}, from start to both launchers' exit")
    print("| rendezvous | levers9 run | torchrun |")
    print("| --- | --- | --- |")
    for form in ("static", "c10d"):
        ours, theirs = (statistics.median(times[(name, form)]) for name in LAUNCHERS)
        print(f"| {form} | {ours:.2f} s | {theirs:.2f} s |")


if __name__ == "__main__":
    main()
