"""A caller with a large heap of its own runs distributed.run(nprocs=2); while both ranks wait, a thread of the
caller makes a full garbage collection. Prints, as one JSON line, how much of the caller's memory became its
own (Private_Dirty, KiB) over that collection, the heap's size, and the collector's state before and after.

    python held_heap.py FOLDER           # the caller froze nothing itself
    python held_heap.py FOLDER --frozen  # the caller froze its objects itself before the run
"""

import gc
import json
import sys
import threading
import time
from pathlib import Path

import torch  # noqa: F401 - a caller that trains has torch imported

from levers9 import distributed as dist

HEAP_OBJECTS = 1_000_000


def private_dirty_kib() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Private_Dirty:"):
            return int(line.split()[1])
    raise RuntimeError("no Private_Dirty in /proc/self/smaps_rollup")


def wait_for(path: Path) -> None:
    while not path.exists():
        time.sleep(0.01)


def rank_waits(folder: str) -> int:
    Path(folder, f"ready-{dist.rank()}").touch()
    wait_for(Path(folder, "go"))
    return dist.rank()


def collect_while_ranks_wait(folder: Path, found: dict) -> None:
    for rank in (0, 1):
        wait_for(folder / f"ready-{rank}")
    before = private_dirty_kib()
    gc.collect()
    found["grew_kib"] = private_dirty_kib() - before
    (folder / "go").touch()


if __name__ == "__main__":
    folder = Path(sys.argv[1])
    heap = [[i] for i in range(HEAP_OBJECTS)]  # a model's worth of small objects, made before the run
    heap_kib = sum(sys.getsizeof(x) for x in heap[:1000]) * HEAP_OBJECTS // 1000 // 1024
    if "--frozen" in sys.argv:
        gc.freeze()
    frozen_before = gc.get_freeze_count()
    found: dict = {}
    collector = threading.Thread(target=collect_while_ranks_wait, args=(folder, found))
    collector.start()
    assert dist.run(rank_waits, str(folder), nprocs=2) == 0
    collector.join()
    still_frozen = id(heap) not in {id(o) for o in gc.get_objects()}  # the collector lists no frozen object
    gc.collect()  # CPython 3.12 freezes its own immortal objects again at a full collection (after any unfreeze)
    print("FOUND " + json.dumps({**found, "heap_kib": heap_kib, "frozen_before": frozen_before,
                                 "frozen_after": gc.get_freeze_count(), "heap_still_frozen": still_frozen}), flush=True)
