"""While distributed.run only starts and watches ranks, the caller's objects are held out of its collector:
its collections then copy none of the pages the forked ranks share with it, and after the run (or a refused
call) the collector is as the caller left it. The copy is measured as the caller's own memory
(Private_Dirty in /proc/self/smaps_rollup) over one full collection made while both ranks wait."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from levers9 import distributed as dist
from levers9.errors import ConfigError

pytestmark = pytest.mark.procs

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "held_heap.py"


def _caller(tmp_path: Path, *flags: str) -> dict:
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), *flags], cwd=REPO, capture_output=True, text=True,
                          timeout=180, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("FOUND ")]
    return json.loads(line.removeprefix("FOUND "))


@pytest.mark.timeout(240)
def test_a_collection_while_forked_ranks_live_copies_none_of_the_callers_heap(tmp_path: Path) -> None:
    """Before: a 62 MB heap of small objects and torch's own made 102 MB of the caller's memory its own."""
    found = _caller(tmp_path)
    assert found["grew_kib"] < found["heap_kib"] / 8, found
    # everything handed back: the collector as the caller left it (CPython 3.12 keeps 375 objects of its own frozen)
    assert found["frozen_after"] == found["frozen_before"] and not found["heap_still_frozen"], found


@pytest.mark.timeout(240)
def test_a_callers_own_freeze_is_kept_as_it_was(tmp_path: Path) -> None:
    """The caller's frozen objects stay frozen. Their count may drop by the few that were freed meanwhile (CPython
    3.13+ frees 2 or 3 of them at the first warning filter change, which levers9's fork makes): none is unfrozen."""
    found = _caller(tmp_path, "--frozen")
    assert found["heap_still_frozen"], found
    assert found["frozen_before"] > 0 and found["frozen_before"] - 16 <= found["frozen_after"] <= found["frozen_before"], found


def _held_in_fn(cfg: object) -> int:
    gc.collect()  # CPython 3.12 freezes its own immortal objects again at a full collection (after any unfreeze)
    return gc.get_freeze_count()


def test_fn_in_place_and_a_refused_call_leave_the_collector_as_the_caller_left_it() -> None:
    before = gc.get_freeze_count()
    assert dist.run(_held_in_fn, None, nprocs=1) == before  # fn runs here: nothing of the caller's held
    with pytest.raises(ConfigError):
        dist.run(_held_in_fn, None, nprocs=2, timeout=-1)
    gc.collect()  # CPython 3.12 freezes its own immortal objects again at a full collection (after any unfreeze)
    assert gc.get_freeze_count() == before
