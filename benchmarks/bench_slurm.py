"""backend="slurm" against submitit's own executor and a hand-written job script, on the same cluster.

Needs a SLURM cluster (SLURM_CONF), e.g. the one of compat_tests/slurm_cluster.sh (as root):

    compat_tests/slurm_cluster.sh start && eval "$(compat_tests/slurm_cluster.sh env)"
    PYTHONPATH=$PWD python benchmarks/bench_slurm.py [--repeat 3] [--cells 200]

    latency      submit one no-op job, wait for its value: `job(noop, backend="slurm").remote()` against
                 `SlurmExecutor.submit(noop).result()` (which polls its result file every second)
    sweep        a no-op map of --cells cells, one job array each (at most --running at once): levers9's
                 `.map` against submitit's `map_array` and `[j.result() for j in jobs]`; per cell
    two nodes    one 4-rank gloo all_reduce on 2 nodes x 2 cards, from submission to the caller having
                 the result: `@job(gpu_count=4)` (srun starts every rank, distributed.run in each) against
                 two hand-written `sbatch` scripts, until rank 0's result is in the job's output:
                 `srun python` with one task per card
                 (MASTER_ADDR from the node list, MASTER_PORT by hand), and `srun torchrun` with one
                 task per node (c10d rendezvous on the first node)

Interleaved, medians printed. A benchmark, not a test: it prints a table and asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import submitit

from levers9 import distributed as dist
from levers9.launch import job
from levers9.launch.settings import update_settings

HAND_WRITTEN = """#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=2 --gres=gpu:2 --output={out}
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=$((20000 + SLURM_JOB_ID % 10000))
srun {python} -c '
import os, torch, torch.distributed as td
td.init_process_group("gloo", rank=int(os.environ["SLURM_PROCID"]), world_size=int(os.environ["SLURM_NTASKS"]))
t = torch.ones(1); td.all_reduce(t)
if td.get_rank() == 0: print("sum", t.item())
td.destroy_process_group()
'
"""

# One torchrun per node. The first node's torchrun is told it hosts the rendezvous (is_host): on this one-machine
# test cluster the first node's name is not the machine's hostname, which c10d would otherwise compare.
HAND_WRITTEN_TORCHRUN = """#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=1 --gres=gpu:2 --output={out}
export TMPDIR={tmp}  # torchrun's agent leaves its torchelastic_* folder there
export HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun bash -c 'h=$([ $SLURM_NODEID = 0 ] && echo true || echo false); exec {python} -m torch.distributed.run \
    --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint $HEAD:$((20000 + SLURM_JOB_ID % 9000)) \
    --rdzv-conf is_host=$h --rdzv-id $SLURM_JOB_ID {worker}'
"""

TORCHRUN_WORKER = """import torch, torch.distributed as td
td.init_process_group("gloo")
t = torch.ones(1); td.all_reduce(t)
if td.get_rank() == 0: print("sum", t.item())
td.destroy_process_group()
"""


def noop(x: int = 0) -> int:
    return x


def all_reduce() -> float:
    import torch
    import torch.distributed as td

    def one_rank() -> float:
        t = torch.ones(1)
        td.all_reduce(t)
        return t.item()

    return dist.run(one_rank)


def settle() -> None:
    """Wait until SLURM runs no job of this user (a case's jobs may still be ending after its result came)."""
    while subprocess.run(["squeue", "-h", "-u", str(os.getuid()), "-o", "%i"], capture_output=True, text=True,
                         check=True).stdout.strip():  # fmt: skip
        time.sleep(0.1)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cells", type=int, default=40)
    parser.add_argument("--running", type=int, default=16, help="the arrays' concurrency limit")
    args = parser.parse_args()
    if not os.environ.get("SLURM_CONF") and not Path("/etc/slurm/slurm.conf").exists():
        sys.exit("no SLURM cluster: start one with compat_tests/slurm_cluster.sh start and set SLURM_CONF")
    with tempfile.TemporaryDirectory(prefix="l9bench-slurm-", dir=os.getcwd()) as root:  # the nodes must see it
        os.environ["LEVERS9_STATE_DIR"] = f"{root}/state"
        os.environ["LEVERS9_CONFIG_DIR"] = f"{root}/config"
        os.environ.setdefault("PYTHONPATH", os.getcwd())
        os.environ["SUBMITIT_LOG_LEVEL"] = "WARNING"
        update_settings(multi_gpu=True)
        executor = submitit.SlurmExecutor(folder=f"{root}/submitit")
        executor.update_parameters(time=None, array_parallelism=args.running, ntasks_per_node=1)
        remote = job(noop, backend="slurm", stream_output=False)
        mapped = job(noop, backend="slurm", stream_output=False, slurm={"max_running": args.running})
        two_nodes = job(all_reduce, gpu_count=4, backend="slurm", stream_output=False)
        script = Path(root) / "hand.sh"
        script.write_text(HAND_WRITTEN.format(out=f"{root}/hand-%j.out", python=sys.executable))
        worker = Path(root) / "worker.py"
        worker.write_text(TORCHRUN_WORKER)
        torchrun_script = Path(root) / "hand-torchrun.sh"
        torchrun_script.write_text(HAND_WRITTEN_TORCHRUN.format(out=f"{root}/hand-torchrun-%j.out", python=sys.executable,
                                                                worker=worker, tmp=root))  # fmt: skip

        def hand_written(path: Path) -> None:
            """Submit the script and wait for rank 0's "sum" line in its output, read every 0.05 s (levers9's
            case ends when rank 0's result is there; `sbatch --wait` polls squeue at 2 s and more, and took
            10.0 s every time, whatever the job took)."""
            done = subprocess.run(["sbatch", "--parsable", str(path)], check=True, capture_output=True, text=True)
            job_id = done.stdout.strip().split(";")[0]
            out = Path(root) / f"{path.stem}-{job_id}.out"
            deadline = time.monotonic() + 120
            while not (out.exists() and "sum 4.0" in out.read_text()):
                if time.monotonic() > deadline:
                    sys.exit(f"{path.name}: no 'sum 4.0' in {out} after 120 s (SLURM job {job_id})")
                time.sleep(0.05)

        cases: dict[str, Callable[[], object]] = {
            "latency, levers9": lambda: remote.remote(1),
            "latency, submitit": lambda: executor.submit(noop, 1).result(),
            "sweep, levers9": lambda: list(mapped.map(range(args.cells))),
            "sweep, submitit": lambda: [j.result() for j in executor.map_array(noop, list(range(args.cells)))],
            "two nodes, levers9": lambda: two_nodes.remote(),
            "two nodes, sbatch+srun": lambda: hand_written(script),
            "two nodes, sbatch+torchrun": lambda: hand_written(torchrun_script),
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.repeat):
            for name, case in cases.items():
                times[name].append(timed(case))
                settle()  # not timed: every case starts on an idle cluster
        print(f"{'case':<30}{'median s':>10}{'per cell ms':>14}   runs")
        for name, values in times.items():
            median = statistics.median(values)
            per_cell = f"{1000 * median / args.cells:.0f}" if name.startswith("sweep") else ""
            print(f"{name:<30}{median:>10.2f}{per_cell:>14}   {', '.join(f'{v:.2f}' for v in values)}")


if __name__ == "__main__":
    main()
