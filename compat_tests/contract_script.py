"""One contract script, run under every launcher; every run must print the same CONTRACT numbers.

    python compat_tests/contract_script.py --mode direct            # plain python: a world of one
    python compat_tests/contract_script.py --mode run --nprocs 2    # levers9 spawns two ranks
    torchrun --nproc-per-node 2 compat_tests/contract_script.py --mode direct
    accelerate launch --multi_gpu --num_processes 2 compat_tests/contract_script.py --mode run
    torchrun --nproc-per-node 2 compat_tests/contract_script.py --mode own-init   # a classic DDP script
    LEVERS9_SIMULATE_GPUS=RTXPro6000:2 python compat_tests/contract_script.py --mode job   # @job(gpu_count=2)

Each training step takes a global batch of 4 rows that `shard` splits across the ranks, and DDP
averages the gradients, so the losses are the same on 1 or 2 ranks. Rank 0 prints one line
`CONTRACT {...}` (the numbers) and one `WORLD {...}` (who launched it and how many ranks).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from typing import Any

import torch

from levers9 import distributed as dist

GLOBAL_BATCH = 4
STEPS = 4


def contract(cfg: dict[str, Any]) -> dict[str, Any]:
    """Shard rows, reduce means and train a few DDP steps; rank 0's numbers come back."""
    rows = list(range(1, 18))
    mine = dist.shard(rows)
    row_total = dist.all_reduce_mean(float(sum(mine))).item() * dist.world_size()
    padded = dist.shard(rows, pad=True)
    padding_total = round(dist.all_reduce_mean(float(padded.padding)).item() * dist.world_size())

    torch.manual_seed(0)
    model = dist.wrap(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(GLOBAL_BATCH * STEPS, 4, generator=g), torch.randn(GLOBAL_BATCH * STEPS, 1, generator=g)
    losses = []
    for step in range(cfg["steps"]):
        batch = dist.shard(list(range(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)))
        x, y = xs[batch].to(dist.device()), ys[batch].to(dist.device())
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(round(dist.all_reduce_mean(loss).item(), 5))
    dist.barrier()
    return {
        "row_total": row_total,
        "padding_total": padding_total,
        "losses": losses,
        "rank0_rows": list(mine) if dist.is_main() else None,
        "world_size": dist.world_size(),
    }


def on_two_cards(cfg: dict[str, Any]) -> dict[str, Any]:
    """The job: one rank per card of the job, through distributed.run."""
    return dist.run(contract, cfg)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["direct", "run", "own-init", "job"], default="direct")
    parser.add_argument("--nprocs", type=int, default=None)
    args = parser.parse_args()
    cfg = {"steps": STEPS}
    if args.mode == "run":
        result = dist.run(contract, cfg, nprocs=args.nprocs)
    elif args.mode == "own-init":
        import torch.distributed as td

        td.init_process_group("gloo")  # the classic DDP script: its own group, from torchrun's env://
        result = contract(cfg)
        gc.collect()  # DDP's pending gloo work must go before the group (pytorch/pytorch#190489)
        td.destroy_process_group()
    elif args.mode == "job":
        from levers9 import job

        result = job(gpu="RTXPro6000", gpu_count=2, timeout=240)(on_two_cards).remote(cfg)
    else:
        result = contract(cfg)
    if dist.is_main():
        world = {"launcher": dist.launcher(), "pid_env_rank": os.environ.get("RANK")}
        print("WORLD " + json.dumps(world), flush=True)
        print("CONTRACT " + json.dumps(result, sort_keys=True), flush=True)


if __name__ == "__main__":
    main()
