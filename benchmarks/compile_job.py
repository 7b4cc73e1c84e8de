"""A torchrun script that trains a small model compiled with torch.compile (inductor, C++ on the CPU) for a
few steps on 2 gloo ranks, the shape of build-nanogpt's `torch.compile(model)` loop; bench_compile.py times it."""

import os
import tempfile

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
# each run compiles afresh, as a new training run does (no inductor cache from the run before)
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))
torch.manual_seed(0)
model = torch.compile(DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(20):
    x = torch.randn(16, 32)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
dist.all_reduce(loss.detach())
dist.destroy_process_group()
