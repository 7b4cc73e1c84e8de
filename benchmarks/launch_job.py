"""The job every launcher runs in the launch benchmark: 2 ranks join a group, do one all_reduce, return.

    python benchmarks/launch_job.py levers9                       # distributed.run(nprocs=2)
    python benchmarks/launch_job.py mp-spawn                      # torch.multiprocessing.spawn
    torchrun --nproc-per-node 2 benchmarks/launch_job.py plain    # torchrun / accelerate launch

With LAUNCH_JOB_LINE_BYTES=N, rank 0 also prints one line of N bytes after the all_reduce.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as td


def one_all_reduce() -> float:
    t = torch.ones(1)
    td.all_reduce(t)
    size = int(os.environ.get("LAUNCH_JOB_LINE_BYTES", "0"))
    if size and td.get_rank() == 0:
        print("x" * size, flush=True)
    return t.item()


def levers9_fn(cfg: object) -> float:
    return one_all_reduce()


def mp_spawn_fn(rank: int, world: int) -> None:
    td.init_process_group("gloo", rank=rank, world_size=world)
    one_all_reduce()
    td.destroy_process_group()


def main() -> None:
    mode = sys.argv[1]
    if mode == "levers9":
        from levers9 import distributed as dist

        assert dist.run(levers9_fn, None, nprocs=2) == 2.0
    elif mode == "mp-spawn":
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as s:  # the usual recipe: pick a free port, hope nobody takes it first
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        mp.spawn(mp_spawn_fn, args=(2,), nprocs=2)
    elif mode == "plain":  # already a rank: torchrun or accelerate launch started us
        td.init_process_group("gloo")
        assert one_all_reduce() == 2.0
        td.destroy_process_group()
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
