"""Parent side: while this process only plans, starts and watches ranks, the objects it had before are held
out of its garbage collector, as CPython advises for a process that forks (`gc.freeze`'s documentation).

`import torch` leaves a full collection due (about 175,000 objects to traverse, 60 to 80 ms here), which
the next few thousand objects any code makes set off. Held, those objects are not traversed by the
collections this process makes meanwhile: starting the ranks does not pay that collection, and a
collection while they live does not write into each object's header, which would copy every page the
ranks still share with this process (copy-on-write). After, they are handed back to the collector as
they were, and the collection that was due falls due again. A caller that froze objects itself keeps its
own freeze as it is: nothing is held or handed back then; the same on CPython 3.12, whose interpreter starts
with objects of its own frozen.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def held_heap() -> Iterator[None]:
    """Within: the objects this process has now are out of its collector's reach (not freed by it, not
    traversed). After, even on an exception: every one of them is back, unless the caller held some itself."""
    if gc.get_freeze_count():  # the caller's own freeze, or CPython 3.12's of its own static types' tuples: leave
        # it (gc.unfreeze would hand back all of it), and hold nothing
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
