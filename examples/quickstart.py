"""levers9 in one minute, on whatever this machine has: one training on several
cards, and many trainings on one card each.

    python examples/quickstart.py

1. Many trainings, one card each: a 4-cell sweep through `@job(...).map`
   (simulated cards and CPU work when the machine has no GPU; it says so).
2. One training, many cards: a short DDP training through `distributed.run`
   (one rank per card on GPUs; two gloo ranks on the CPU otherwise), losses
   printed by rank 0 with `print0`.
"""

from __future__ import annotations

import os
import time

from sweep import cell  # @job(gpu="any", gpu_count=1): one sweep cell
from train_ddp import train_one_rank  # the training loop, one call per rank

from levers9 import distributed as dist
from levers9.distributed.hardware.cards import visible_cards


def main() -> None:
    cards = visible_cards()
    if not cards and "LEVERS9_SIMULATE_GPUS" not in os.environ:
        os.environ["LEVERS9_SIMULATE_GPUS"] = "RTXPro6000:4"
        print("No GPU here: the sweep runs on 4 simulated cards "
              "(LEVERS9_SIMULATE_GPUS=RTXPro6000:4), on the CPU.")
    else:
        names = ", ".join(f"{c.index}: {c.type_name}" for c in cards)
        print(f"Cards: {names or os.environ['LEVERS9_SIMULATE_GPUS']}")

    print("\n1. Many trainings, one card each: cell.map over 4 settings")
    start = time.perf_counter()
    for r in cell.map([(8, 1e-3), (16, 1e-3), (32, 1e-3), (64, 2e-3)]):
        print(f"  lora_r={r['lora_r']:>2} lr={r['lr']:.0e} "
              f"loss={r['loss']:.4f} on card {r['card']}")
    print(f"  sweep took {time.perf_counter() - start:.1f} s")

    nprocs = None if cards else 2
    ranks = len(cards) or 2
    print(f"\n2. One training, many cards: distributed.run with {ranks} ranks")
    start = time.perf_counter()
    result = dist.run(train_one_rank, {"steps": 20, "lr": 0.05}, nprocs=nprocs)
    print(f"  rank 0 returned {result}")
    print(f"  training took {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
