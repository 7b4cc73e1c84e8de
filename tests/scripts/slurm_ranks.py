"""Run under srun: dist.run(fn) in every task (argv[1]: nprocs); each rank prints one JSON line with what it saw."""

import json
import os
import socket

import torch.distributed as td

from levers9 import distributed as dist


def report() -> dict:
    """What this rank sees when fn starts: its place in the world, and a live group (an all_reduce)."""
    import torch

    total = torch.tensor([1.0])
    td.all_reduce(total)  # the group is live when fn starts
    line = {
        "rank": dist.rank(), "local_rank": dist.local_rank(), "world_size": dist.world_size(),
        "local_world_size": dist.local_world_size(), "node_rank": dist.node_rank(), "launcher": dist.launcher(),
        "sum": total.item(), "node": os.environ.get("SLURMD_NODENAME", socket.gethostname()),
        "master": f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
    }
    print("RANK " + json.dumps(line), flush=True)
    return line["rank"] * 10


if __name__ == "__main__":
    import sys

    value = dist.run(report, nprocs=int(sys.argv[1]) if len(sys.argv) > 1 else None)
    print(f"VALUE {value}", flush=True)
