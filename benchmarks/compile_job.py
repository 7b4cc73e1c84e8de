"""A torchrun script that trains a small model compiled with torch.compile (inductor, C++ on the CPU) for a
few steps on 2 gloo ranks, the shape of build-nanogpt's `torch.compile(model)` loop; bench_compile.py times it."""

import os
import tempfile

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
# each run compiles afresh, as a new training run does: bench_compile.py gives each run a cache folder of its
# own; run by hand, the ranks share one for this run, in the temp folder torchrun gives them
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"inductor-{os.environ['TORCHELASTIC_RUN_ID']}")
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
