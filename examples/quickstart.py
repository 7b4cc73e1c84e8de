"""levers9 in one minute: both shapes of the seed on whatever this machine has.

    python examples/quickstart.py

1. Many trainings, one card each: a 4-cell sweep through `@job(...).map` (simulated cards and CPU
   work when the machine has no GPU; it says so).
2. One training, many cards: a short DDP training through `distributed.run` (one rank per card on
   GPUs; two gloo ranks on the CPU otherwise), losses printed by rank 0 with `print0`.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from tiny import batch, load_model, make_rows

from levers9 import distributed as dist
from levers9 import job
from levers9.distributed.cards import visible_cards


@job(gpu="any", gpu_count=1, timeout=600)
def cell(lora_r: int, lr: float) -> dict[str, Any]:
    """One sweep cell: fine-tune the adapter of rank `lora_r` at `lr` on this job's own card."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(lora_r).to(dev)
    opt = torch.optim.Adam(model.lora.parameters() if model.lora is not None else model.parameters(), lr=lr)
    rows = make_rows()
    for step in range(100):
        x, y = batch(rows[(step * 16) % 256 : (step * 16) % 256 + 16], dev)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {"lora_r": lora_r, "lr": lr, "loss": round(loss.item(), 4), "card": os.environ.get("CUDA_VISIBLE_DEVICES")}


def train_one_rank(cfg: dict[str, Any]) -> dict[str, Any]:
    """The seed's loop: each rank trains on its own rows; DDP averages the gradients."""
    dev = dist.device()
    model = dist.wrap(load_model().to(dev))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rows = make_rows()
    for step in range(cfg["steps"]):
        start = (step * dist.world_size() + dist.rank()) * 8
        x, y = batch([rows[(start + i) % len(rows)] for i in range(8)], dev)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 5 == 0 or step == cfg["steps"] - 1:
            dist.print0(f"  step {step:>2} loss={dist.all_reduce_mean(loss).item():.4f}")
    dist.barrier()
    return {"world_size": dist.world_size(), "device": str(dev)} if dist.is_main() else {}


def main() -> None:
    cards = visible_cards()
    if not cards and "LEVERS9_SIMULATE_GPUS" not in os.environ:
        os.environ["LEVERS9_SIMULATE_GPUS"] = "RTXPro6000:4"
        print("No GPU here: the sweep runs on 4 simulated cards (LEVERS9_SIMULATE_GPUS=RTXPro6000:4), on the CPU.")
    else:
        print(f"Cards: {', '.join(f'{c.index}: {c.type_name}' for c in cards) or os.environ['LEVERS9_SIMULATE_GPUS']}")

    print("\n1. Many trainings, one card each: cell.map over 4 settings")
    start = time.perf_counter()
    for r in cell.map([(8, 1e-3), (16, 1e-3), (32, 1e-3), (64, 2e-3)]):
        print(f"  lora_r={r['lora_r']:>2} lr={r['lr']:.0e} loss={r['loss']:.4f} on card {r['card']}")
    print(f"  sweep took {time.perf_counter() - start:.1f} s")

    nprocs = None if cards else 2
    print(f"\n2. One training, many cards: distributed.run with {len(cards) or 2} ranks")
    start = time.perf_counter()
    result = dist.run(train_one_rank, {"steps": 20}, nprocs=nprocs)
    print(f"  rank 0 returned {result}")
    print(f"  training took {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
