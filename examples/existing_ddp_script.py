"""A classic DDP script that makes its own process group, with levers9's helpers
dropped in.

    torchrun --nproc-per-node 2 examples/existing_ddp_script.py

Nothing about the script changes but the import: the helpers read the live group
it created.
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as td
from tiny import batch, load_model, make_rows
from torch.nn.parallel import DistributedDataParallel

from levers9 import distributed as dist


def main() -> None:
    # the script's own group
    td.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    dev = dist.device()                     # levers9: this rank's card
    ids = [dev.index] if dev.type == "cuda" else None
    model = DistributedDataParallel(load_model().to(dev), device_ids=ids)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rows = dist.shard(make_rows())          # levers9: this rank's slice
    for step in range(20):
        x, y = batch(rows[(step * 8) % len(rows) :][:8], dev)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = dist.all_reduce_mean(loss).item()     # levers9: across ranks
        dist.print0(f"step {step} loss={mean:.4f}")  # levers9: rank 0 speaks
    assert dist.wrap(model) is model        # levers9 never wraps twice
    world, rank = dist.world_size(), dist.rank()
    dist.print0(f"launcher={dist.launcher()} world_size={world} rank={rank}")
    del model, opt
    gc.collect()  # DDP's pending gloo work goes before the group (pytorch#190489)
    td.destroy_process_group()


if __name__ == "__main__":
    main()
