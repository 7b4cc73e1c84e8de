"""A torchrun script for a terminal: each rank says whether it sees one; rank 0 redraws a progress line with
"\\r" (each redraw waits for the file ARGV1.<i>, which the test makes once it saw that redraw on the screen),
writes bytes that are not UTF-8, and asks for a name on its stdin."""

import os
import sys
import time

import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"rank {rank} isatty={sys.stdout.isatty()} columns={os.get_terminal_size().columns if sys.stdout.isatty() else 0}",
      flush=True)
if rank == 0:
    for i in range(3):
        sys.stdout.write(f"\rstep {i}/3")
        sys.stdout.flush()
        while not os.path.exists(f"{sys.argv[1]}.{i}"):
            time.sleep(0.01)
    sys.stdout.write("\n")
    sys.stdout.flush()
    sys.stdout.buffer.write(b"raw \xff\xfe bytes\n")
    sys.stdout.flush()
    print(f"hello {input('name? ')!r}", flush=True)
dist.barrier()
dist.destroy_process_group()
