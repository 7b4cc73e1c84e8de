"""Parent side: while this process only plans, starts and watches ranks, the objects it had before are held
out of its garbage collector, as CPython advises for a process that forks (`gc.freeze`'s documentation).

`import torch` leaves a full collection due (about 175,000 objects to traverse, 60 to 80 ms here), which
the next few thousand objects any code makes set off. Held, those objects are not traversed by the
collections this process makes meanwhile: starting the ranks does not pay that collection, and a
collection while they live does not write into each object's header, which would copy every page the
ranks still share with this process (copy-on-write). After, they are handed back to the collector as
they were, and the collection that was due falls due again. A caller that froze objects itself keeps its
own freeze as it is: nothing is held or handed back then.

CPython 3.12 keeps objects of its own frozen (its immortal static types' tuples: 375 in a bare interpreter), and
puts them back in the frozen generation at every full collection; a freeze of no more than that is the
interpreter's, not the caller's.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import subprocess
import sys
from collections.abc import Iterator


@functools.cache
def _interpreters_own_freeze() -> int:
    """How many objects this Python keeps frozen of its own: 0, but on CPython 3.12 (read once, from a bare
    interpreter of the same executable)."""
    if sys.version_info[:2] != (3, 12):
        return 0
    with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
        bare = subprocess.run([sys.executable, "-I", "-S", "-c", "import gc; print(gc.get_freeze_count())"],
                              capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
        return int(bare.stdout)
    return 0


@contextlib.contextmanager
def held_heap() -> Iterator[None]:
    """Within: the objects this process has now are out of its collector's reach (not freed by it, not
    traversed). After, even on an exception: every one of them is back, unless the caller held some itself."""
    if gc.get_freeze_count() > _interpreters_own_freeze():  # the caller's own freeze: leave it, and hand back nothing
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
