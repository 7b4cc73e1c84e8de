"""Many trainings, one card each: a LoRA-rank x learning-rate sweep with a tiny
model.

    python examples/sweep.py

Each cell is its own job on its own card, all at once; results come back in
input order. On a machine without cards, set LEVERS9_SIMULATE_GPUS="RTXPro6000:4"
(the cells then run on the CPU).
"""

from __future__ import annotations

import os
import time

import torch
from tiny import batch, load_model, make_rows

from levers9 import job


@job(gpu="any", gpu_count=1, timeout=600)
def cell(lora_r: int, lr: float) -> dict[str, float | int | str]:
    """Fine-tune the tiny model's adapter of rank `lora_r` at `lr`; the final loss
    comes back."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(lora_r).to(dev)
    trained = model.lora if model.lora is not None else model
    opt = torch.optim.Adam(trained.parameters(), lr=lr)
    rows = make_rows()
    for step in range(60):
        x, y = batch(rows[(step * 16) % 256 : (step * 16) % 256 + 16], dev)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    card = os.environ.get("CUDA_VISIBLE_DEVICES", "")  # the card this job holds
    return {"lora_r": lora_r, "lr": lr, "loss": round(loss.item(), 4),
            "card": card}


if __name__ == "__main__":
    start = time.perf_counter()
    results = list(cell.map([(8, 1e-4), (16, 1e-4), (32, 1e-4), (64, 2e-4)]))
    for r in results:
        print(f"lora_r={r['lora_r']:>3} lr={r['lr']:.0e} "
              f"loss={r['loss']:.4f} card={r['card']}")
    print(f"{len(results)} cells in {time.perf_counter() - start:.1f} s")
