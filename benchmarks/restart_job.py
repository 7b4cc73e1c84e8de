"""The job both launchers restart in the restart benchmark: rank 1 dies on the first attempt, inside a step.

    python benchmarks/restart_job.py levers9 FOLDER                                        # distributed.run
    torchrun --standalone --nproc-per-node 2 --max-restarts 1 benchmarks/restart_job.py plain FOLDER

Every rank writes the time it entered `fn` (its group joined) to FOLDER/entered-<attempt>-<rank>; on
the first attempt rank 1 writes the time it dies to FOLDER/died and SIGKILLs itself while rank 0 waits
for it in a collective. The attempt is read from TORCHELASTIC_RESTART_COUNT, which both launchers set.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as td


def fn(folder: str) -> float:
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    Path(folder, f"entered-{attempt}-{td.get_rank()}").write_text(repr(time.time()))
    td.barrier()  # every rank is in fn
    if attempt == 0 and td.get_rank() == 1:
        Path(folder, "died").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(1)
    td.all_reduce(t)  # attempt 0: rank 0 waits here for the rank that died
    return t.item()


def main() -> None:
    mode, folder = sys.argv[1], sys.argv[2]
    if mode == "levers9":
        from levers9 import distributed as dist

        assert dist.run(fn, folder, nprocs=2, max_restarts=1, restart_delay=0) == 2.0
    elif mode == "plain":  # a rank already: torchrun started us
        td.init_process_group("gloo")
        assert fn(folder) == 2.0
        td.destroy_process_group()
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
