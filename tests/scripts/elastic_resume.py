"""The shape of torch's elastic ImageNet example (examples/distributed/ddp-elastic): a checkpoint per epoch, written by
rank 0 and resumed from on a restart, which the script learns from TORCHELASTIC_RESTART_COUNT. On the first attempt
rank 1 raises OSError in epoch 1 (its data file went away), so only a launcher that restarts after an exception
finishes; the result is the same however many attempts it took."""

import json
import os
import sys

import torch
import torch.distributed as td

folder = sys.argv[1]
td.init_process_group("gloo")
rank = td.get_rank()
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
checkpoint = os.path.join(folder, "checkpoint.pt")
first, weight = 0, torch.zeros(4)
if os.path.exists(checkpoint):
    state = torch.load(checkpoint)
    first, weight = state["epoch"] + 1, state["weight"]
for epoch in range(first, 3):
    if epoch == 1 and rank == 1 and restart == 0:
        raise OSError(f"rank 1 lost its data file in epoch {epoch}")
    grad = torch.full((4,), float(rank + 1 + epoch))
    td.all_reduce(grad)
    weight += 0.1 * grad
    if rank == 0:
        torch.save({"epoch": epoch, "weight": weight}, checkpoint + ".tmp")
        os.replace(checkpoint + ".tmp", checkpoint)  # a checkpoint is written whole
    td.barrier()
    print(f"restart {restart} epoch {epoch}", flush=True)
if rank == 0:
    print("RESULT " + json.dumps([round(x, 4) for x in weight.tolist()]), flush=True)
td.destroy_process_group()
