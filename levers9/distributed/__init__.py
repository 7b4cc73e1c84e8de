"""levers9.distributed: one training function on 1, 2, 4 or 8 cards.

    from levers9 import distributed as dist

    def train_one_rank(cfg):
        model = dist.wrap(build_model().to(dist.device()))
        for batch in dist.shard(rows): ...
        dist.print0(f"loss {dist.all_reduce_mean(loss).item():.4f}")
        return metrics if dist.is_main() else {}

    dist.run(train_one_rank, cfg)        # one rank per card; rank 0's result comes back
    dist.run_script("train.py", ["--epochs", "3"])   # a torchrun script, unchanged (`levers9 run` in Python)
    dist.spawn(main, args=(world,), nprocs=2)        # torch.multiprocessing.spawn's signature
    dist.run(train_one_rank, cfg, max_restarts=3)   # every rank started again after a crash or stall

Under torchrun, `accelerate launch`, SLURM or MPI the same helpers read the launcher's RANK /
WORLD_SIZE / LOCAL_RANK, and `run` starts no ranks. With nothing launched, every helper answers as a
world of one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from levers9.lazy_names import lazy_names

if TYPE_CHECKING:
    from levers9.distributed.detect import (
        is_main,
        launcher,
        local_rank,
        local_world_size,
        node_rank,
        rank,
        restart_count,
        world_size,
    )
    from levers9.distributed.helpers import PaddedShard, all_reduce_mean, barrier, device, print0, shard, wrap
    from levers9.distributed.mpspawn import spawn
    from levers9.distributed.running import run
    from levers9.distributed.script import run_script

__all__ = [
    "run",
    "run_script",
    "spawn",
    "rank",
    "local_rank",
    "world_size",
    "local_world_size",
    "node_rank",
    "is_main",
    "launcher",
    "device",
    "wrap",
    "shard",
    "PaddedShard",
    "all_reduce_mean",
    "print0",
    "barrier",
    "restart_count",
]

# Each public name loads with its module on first use, not with the package (levers9/lazy_names.py): loading
# run, run_script and spawn here put about 30 ms of modules on every import of a module under it.
__getattr__ = lazy_names(__name__, {
    **dict.fromkeys(("PaddedShard", "all_reduce_mean", "barrier", "device", "print0", "shard", "wrap"), ".helpers"),
    "spawn": ".mpspawn",
    "run": ".running",
    "run_script": ".script",
    **dict.fromkeys(("is_main", "launcher", "local_rank", "local_world_size", "node_rank", "rank", "restart_count",
                     "world_size"), ".detect"),  # fmt: skip
})
