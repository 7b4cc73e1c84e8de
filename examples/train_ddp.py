"""A `train_one_rank` training loop (a small model on synthetic audio/text rows),
with gpu_count as the only knob.

    python examples/train_ddp.py --gpu-count 2  # a job on 2 cards, 2 ranks in it
    python examples/train_ddp.py --gpu-count 1  # the same function, one card

On a machine without cards, set LEVERS9_SIMULATE_GPUS="RTXPro6000:4" (CPU ranks
on gloo). More than one card per job needs the workspace switch:
`levers9 workspace multi-gpu on`.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from tiny import batch, load_model, make_rows

from levers9 import distributed as dist
from levers9 import job

BATCH_PER_RANK = 8


def train_one_rank(cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank's training loop; rank 0's return value is what the job returns."""
    dev = dist.device()                      # this rank's card (or the CPU)
    model = dist.wrap(load_model().to(dev))  # DDP; the model itself on one card
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    rows = make_rows()
    for step in range(cfg["steps"]):
        # each rank its own rows
        start = (step * dist.world_size() + dist.rank()) * BATCH_PER_RANK
        picked = [rows[(start + i) % len(rows)] for i in range(BATCH_PER_RANK)]
        x, y = batch(picked, dev)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 10 == 0 or step == cfg["steps"] - 1:
            mean = dist.all_reduce_mean(loss).item()     # the mean across cards
            dist.print0(f"step {step} loss={mean:.4f}")  # rank 0 speaks
    dist.barrier()
    if not dist.is_main():
        return {}
    x, y = batch(rows, dev)
    with torch.no_grad():
        final = torch.nn.functional.mse_loss(model(x), y).item()
    return {"world_size": dist.world_size(), "final_loss": round(final, 4)}


def train(steps: int) -> dict[str, Any]:
    """The job: one process holding all its cards; distributed.run starts one rank
    per card."""
    return dist.run(train_one_rank, {"steps": steps, "lr": 0.05})


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpu-count", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    train_job = job(gpu="any", gpu_count=args.gpu_count, timeout=600)(train)
    print(train_job.remote(args.steps))


if __name__ == "__main__":
    main()
