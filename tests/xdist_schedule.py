"""How `pytest -n N --dist loadgroup` hands the suite to its workers: the Ray group first, on a worker of its own."""

from __future__ import annotations

from typing import Any

from xdist.scheduler import LoadGroupScheduling

RAY_GROUP = "ray"


class RayApartScheduling(LoadGroupScheduling):
    """`--dist loadgroup`, except that the `ray` group goes, at the start, to one worker that runs nothing else.

    The Ray tests are the suite's longest chain (the session's Ray, then a two-node cluster), so they start
    first rather than last; and a process that has run `ray.init` must start nothing by fork afterwards, so
    their worker stops when they end. The other workers share every other test, in collection order. With
    one worker the Ray group simply runs last, as in a run without workers.
    """

    def __init__(self, config: Any, log: Any = None) -> None:
        super().__init__(config, log)
        self.ray_worker: Any = None

    def _assign_work_unit(self, node: Any) -> None:
        """Give `node` the Ray group if no worker has it yet and another worker is left for the rest, else the
        next other unit (the Ray group only when nothing else is left)."""
        takes_ray = RAY_GROUP in self.workqueue and self.ray_worker is None and len(self.nodes) > 1
        scope = RAY_GROUP if takes_ray else next((s for s in self.workqueue if s != RAY_GROUP), RAY_GROUP)
        if scope == RAY_GROUP:
            self.ray_worker = node
        self.workqueue.move_to_end(scope, last=False)  # loadgroup's own assignment takes the first unit
        super()._assign_work_unit(node)

    def _reschedule(self, node: Any) -> None:
        """The Ray worker takes no more work and stops when its group is done; the others work as loadgroup's do."""
        if node.shutting_down:
            return
        if node is self.ray_worker and len(self.nodes) > 1:
            if not self._pending_of(self.assigned_work[node]):
                node.shutdown()
            return
        super()._reschedule(node)
