"""A script written for four ranks: it passes world_size=4 to init_process_group."""

import os

import torch.distributed as dist

if __name__ == "__main__":
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=4)
