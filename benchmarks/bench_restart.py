"""Restart cost: from a rank's death to every new rank being back inside fn, levers9 vs torchrun.

    nice python benchmarks/bench_restart.py --repeats 7
    python benchmarks/bench_restart.py --repeats 5 --before /tmp/before   # also the code before, side by side

The same script (restart_job.py) runs under `distributed.run(max_restarts=1, restart_delay=0)` and
under `torchrun --standalone --nproc-per-node 2 --max-restarts 1`, interleaved round by round so
machine noise hits both alike. Rank 1 dies (SIGKILL) on the first attempt while rank 0 waits for it
in an all_reduce; the figure is the latest new rank's entry into fn (its group joined) minus the
time of death, both written by the ranks themselves.

torch 2.13's torchrun fails its own restart here: the new ranks share the agent's rendezvous store
with the dead attempt's keys and gloo connects to the dead rank's old address ("Gloo connectFullMesh
failed ... Connection refused"; pytorch/pytorch#135712, #167288), with --standalone and with a static
--master-port alike. The benchmark runs torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, the
workaround from that issue, so that its restart succeeds at all. With --before TREE, `distributed.run` also
runs with that checkout's levers9 first on PYTHONPATH (and this one's, for its own row), in the same rounds.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from precompiled import precompile

HERE = Path(__file__).resolve().parent
JOB = str(HERE / "restart_job.py")
BIN = Path(sys.executable).parent
TORCHRUN = str(BIN / "torchrun") if (BIN / "torchrun").exists() else "torchrun"

TORCHRUN_CMD = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", JOB, "plain"]
LAUNCHERS: dict[str, tuple[list[str], dict[str, str]]] = {  # command, extra environment
    "levers9 distributed.run": ([sys.executable, JOB, "levers9"], {}),
    "torchrun --max-restarts 1": (TORCHRUN_CMD, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}),
}


def restart_seconds(cmd: list[str], extra_env: dict[str, str]) -> float:
    """One run of `cmd` with a fresh folder: seconds from rank 1's death to the last new rank entering fn."""
    with tempfile.TemporaryDirectory() as tmp:  # torchrun's agent leaves torchelastic_* folders in $TMPDIR
        folder = Path(tmp, "marks")
        folder.mkdir()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": tmp, **extra_env}
        done = subprocess.run([*cmd, str(folder)], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}")
        died = float((folder / "died").read_text())
        back = max(float((folder / f"entered-1-{rank}").read_text()) for rank in (0, 1))
    return back - died


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--before", help="a checkout of the code before a change, run side by side")
    args = parser.parse_args()
    launchers = dict(LAUNCHERS)
    if args.before:
        cmd = launchers.pop("levers9 distributed.run")[0]
        launchers = {"distributed.run, this checkout": (cmd, {"PYTHONPATH": str(HERE.parent)}),
                     "distributed.run, before": (cmd, {"PYTHONPATH": args.before}), **launchers}  # fmt: skip
    for tree in (HERE.parent, *([Path(args.before)] if args.before else [])):  # as installed: bytecode compiled
        precompile(tree)
    times: dict[str, list[float]] = {name: [] for name in launchers}
    for cmd, extra_env in launchers.values():  # warm the page cache once, untimed
        restart_seconds(cmd, extra_env)
    for _ in range(args.repeats):
        for name, (cmd, extra_env) in launchers.items():
            times[name].append(restart_seconds(cmd, extra_env))
    base = statistics.median(times["torchrun --max-restarts 1"])
    print(f"death of a rank to every new rank back in fn; median of {args.repeats}; python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs")  # fmt: skip
    print(f"{'launcher':31} {'median s':>9} {'min s':>7} {'max s':>7} {'vs torchrun':>12}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:31} {median:9.3f} {min(values):7.3f} {max(values):7.3f} {median / base:11.2f}x")


if __name__ == "__main__":
    main()
