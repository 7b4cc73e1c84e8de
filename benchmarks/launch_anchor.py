"""The least a 2-rank job can cost: the anchor row of the launch benchmark (bench_launch.py).

    python benchmarks/launch_anchor.py             # the anchor
    python benchmarks/launch_anchor.py --collect   # the anchor, paying the collection torch's import leaves due

Written by hand, with nothing a launcher does: torch is imported once, this process hosts a TCPStore on a port
the system picks, forks two ranks that join a gloo group through it, do one all_reduce and leave, and waits
for them. No output forwarding, no failure handling, no stop on a sibling's failure, no clean-up of strays.

`import torch` leaves a full garbage collection due (about 175,000 objects to traverse, 60 to 80 ms here): the
next ~4,700 objects any code makes set it off. The anchor makes fewer, so it never pays it; a launcher, or a
script that builds anything, does. `--collect` runs that collection (`gc.collect()`) right after the imports,
so the anchor's cost can be read with and without it.
"""

from __future__ import annotations

import datetime
import gc
import os
import sys

import torch
import torch.distributed as td

WORLD = 2


def rank_main(rank: int, port: int) -> None:
    store = td.TCPStore("127.0.0.1", port, WORLD, False, datetime.timedelta(seconds=60))
    td.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    t = torch.ones(1)
    td.all_reduce(t)
    assert t.item() == WORLD
    td.destroy_process_group()


def main() -> None:
    if "--collect" in sys.argv[1:]:
        gc.collect()
    server = td.TCPStore("127.0.0.1", 0, WORLD, True, datetime.timedelta(seconds=60), wait_for_workers=False)
    pids = []
    for rank in range(WORLD):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                rank_main(rank, server.port)
            except BaseException:
                code = 1
            os._exit(code)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    if codes != [0] * WORLD:
        raise SystemExit(f"ranks exited with {codes}")


if __name__ == "__main__":
    main()
