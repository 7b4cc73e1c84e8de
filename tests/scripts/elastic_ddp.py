"""The PyTorch DDP tutorial's torchrun example (elastic_ddp.py), on gloo so that it runs on a CPU.

One change: the DDP model is freed before destroy_process_group, because gloo threads that still hold
it when the interpreter exits can abort the process (it happens under torchrun too, now and then).
"""

import gc

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def train_step(rank):
    torch.manual_seed(rank)  # different data on each rank; DDP keeps the weights equal
    model = ToyModel()
    ddp_model = DDP(model)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)
    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10))
    labels = torch.randn(20, 5)
    loss_fn(outputs, labels).backward()
    optimizer.step()
    return sum(p.detach().double().sum().item() for p in model.parameters())


def demo_basic():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"Start running basic DDP example on rank {rank}.")
    checksum = train_step(rank)
    gc.collect()
    dist.destroy_process_group()
    print(f"Finished running basic DDP example on rank {rank} checksum={checksum:.6f}.")


if __name__ == "__main__":
    demo_basic()
