"""The Ray backend: the same @job cells, each one Ray task holding its cards on one node at once.

    @job(gpu="RTXPro6000", gpu_count=2, backend="ray")      # or LEVERS9_BACKEND=ray
    RAY_ADDRESS=head:6379 python sweep.py                   # no RAY_ADDRESS: a local Ray on this machine

Ray's scheduler does the gang allocation: a task asks for `num_gpus=N` and, for a named type, the
custom resource `levers9_<type>: N` that `levers9 ray node-args` declares on each node. Before
anything is submitted, the alive nodes are read and a job no node could ever hold fails at once.

The task supervises the job as its own process (node_task.py) and streams its output and outcome back
as the items of a Ray generator; the caller turns them into the same results, exceptions, logs and
retries as locally. Cancelling kills the task with ray.cancel(force=True); the job process notices
through its lifeline pipe and its whole group dies with the task.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, NoReturn

import ray

from levers9.errors import FailureKind, InfeasibleJobError, JobTimeout, NotShippableError, first_line
from levers9.launch import job_process, outcomes
from levers9.launch.backend import Batch, dispatch
from levers9.launch.cells import Cell
from levers9.launch.job_process import GangSlot, TaskEnded, TaskPayload
from levers9.launch.local import LocalBackend
from levers9.launch.outcomes import Cancelled
from levers9.launch.pool import holds_cards
from levers9.launch.ray import gang as ray_gang
from levers9.launch.ray.gang import Node
from levers9.launch.ray.node_task import TaskOutput, TaskStarted, node_task
from levers9.launch.ray.resources import node_resources, resource_name
from levers9.launch.spec import JobSpec
from levers9.procs.failure import ship

log = logging.getLogger("levers9.launch.ray")

CANCEL_EVERY = 0.5  # seconds between repeats of ray.cancel until a cancelled task is over
_connect_lock = threading.Lock()


class RayBackend:
    """Runs batches as Ray tasks on the cluster at RAY_ADDRESS, or on a local Ray started on demand."""

    def __init__(self) -> None:
        self.admission = Admission()

    def submit(self, batch: Batch) -> list[Future[Any]]:
        """Connect, check that some alive node could hold the job, then run the cells on lanes (backend.py):
        twice as many as the alive nodes could run at once, so the next task is already queued in Ray
        when one ends. A GPU job started inside a job that holds cards runs on those cards instead (see
        pool.py): the caller keeps its Ray GPUs while it waits, so asking Ray for others could deadlock."""
        if batch.spec.gpu_count > 0 and holds_cards():
            return LocalBackend().submit(batch)
        connect()
        nodes = alive_nodes()
        plan = _plan(batch.spec, nodes)
        if plan.gang is not None:
            log.info("%s: %s", batch.spec.name, plan.gang.describe())
        func_blob = job_process.ship_for(batch.func, batch.spec.name, "a Ray task",
                                         "Define it at module level, with arguments and globals that can be pickled.")  # fmt: skip
        sys_path = tuple(p for p in sys.path if p)
        cells: list[_RayCell] = []
        for cell in batch.cells:
            try:
                arguments = ship((cell.args, dict(cell.kwargs)))
            except Exception as exc:
                raise NotShippableError(
                    f"the arguments of {batch.cell_label(cell)} {cell.describe()} cannot be pickled "
                    f"({type(exc).__name__}: {exc}); pass plain data, or a path to a file."
                ) from exc
            payload = TaskPayload(sys_path, func_blob, arguments, batch.spec, batch.run_id, cell.index,
                                  gpu_type=plan.gpu_type)  # fmt: skip
            cells.append(_RayCell(self, batch, cell, plan, payload))
        dispatch(batch, cells, 2 * plan.capacity(nodes))
        return [c.future for c in cells]


def connect() -> None:
    """Use the Ray this process is connected to; else RAY_ADDRESS; else start a local Ray with this
    machine's cards (or LEVERS9_SIMULATE_GPUS's), declared as levers9_<type> resources."""
    with _connect_lock:
        if ray.is_initialized():
            return
        address = os.environ.get("RAY_ADDRESS")
        if address:
            log.info("connecting to the Ray cluster at %s (RAY_ADDRESS)", address)
            ray.init(address=address, log_to_driver=False)
            return
        gpus, resources = node_resources()
        log.info("starting a local Ray with %d GPU(s) %s; set RAY_ADDRESS to use a cluster", gpus, resources)
        ray.init(
            address="local", num_gpus=gpus, resources=resources, include_dashboard=False, log_to_driver=False
        )


def alive_nodes() -> list[Node]:
    """The cluster's alive nodes and their total resources."""
    return [
        Node(str(n.get("NodeManagerAddress", "?")), dict(n.get("Resources", {})))
        for n in ray.nodes()
        if n.get("Alive")
    ]


@dataclasses.dataclass(frozen=True)
class TaskRequest:
    """What one task of the job asks Ray for."""

    num_gpus: int
    num_cpus: float
    resources: dict[str, float]
    memory: int | None
    gpu_type: str  # the type chosen from the job's list ('' for any type or a CPU job)
    gang: ray_gang.GangPlan | None = None  # across several nodes: num_gpus and resources are one node's share

    @property
    def shape(self) -> tuple[Any, ...]:
        return (self.num_gpus, self.num_cpus, self.memory, tuple(sorted(self.resources.items())), self.gang)

    @property
    def need(self) -> dict[str, float]:
        """What one task takes from a node's resources (those it needs none of left out)."""
        need = {"GPU": float(self.num_gpus), "CPU": self.num_cpus, **self.resources}
        if self.memory is not None:
            need["memory"] = float(self.memory)
        return {k: v for k, v in need.items() if v}

    def fits(self, node: Node) -> bool:
        return all(node.resources.get(k, 0.0) >= v for k, v in self.need.items())

    def capacity(self, nodes: list[Node]) -> int:
        """How many tasks of this plan the alive `nodes` could run at once (at least 1)."""
        need = self.need
        if not need:
            return max(1, sum(int(node.resources.get("CPU", 1)) for node in nodes))
        tasks = sum(int(min(node.resources.get(k, 0.0) // v for k, v in need.items())) for node in nodes)
        return max(1, tasks if self.gang is None else tasks // self.gang.nodes)

    def options(self, name: str) -> dict[str, Any]:
        opts: dict[str, Any] = {
            "num_gpus": self.num_gpus,
            "num_cpus": self.num_cpus,
            "resources": self.resources,
            "max_retries": 0,  # levers9 retries, by the job's own Retries, in this process
            "retry_exceptions": False,
            "name": name,
        }
        if self.memory is not None:
            opts["memory"] = self.memory
        return opts


def plan_job(spec: JobSpec, nodes: list[Node]) -> TaskRequest:
    """The resources of one task; InfeasibleJobError naming the largest node if no alive node could hold it.

    A GPU job reserves no CPU unless cpu= says so (the cards are what it waits for); a CPU job one
    core, or cpu=. Of several types, the first that some node could hold is used.
    """
    n = spec.gpu_count
    num_cpus = spec.cpu if spec.cpu is not None else (0.0 if n else 1.0)
    memory = _memory_bytes(spec)
    cluster = (
        f"{len(nodes)} alive node(s): " + "; ".join(nd.describe() for nd in nodes)
        if nodes
        else "no alive node"
    )
    if n == 0:
        request = TaskRequest(0, num_cpus, {}, memory, "")
        if not any(request.fits(nd) for nd in nodes):
            raise InfeasibleJobError(
                f"Job {spec.name!r} needs {num_cpus:g} CPU(s){_mem(memory)} but no Ray node has that ({cluster}). "
                f"Lower cpu=/memory=, or add a node with `ray start --address=...`."
            )
        return request
    for gpu_type in spec.gpu_types or ("",):
        resources = {resource_name(gpu_type): float(n)} if gpu_type else {}
        request = TaskRequest(n, num_cpus, resources, memory, gpu_type)
        if any(request.fits(nd) for nd in nodes):
            return request
    largest = max(nodes, key=lambda nd: (nd.gpus, nd.resources.get("CPU", 0)), default=None)
    biggest = f"the largest node is {largest.describe()}" if largest else "the cluster has no alive node"
    raise InfeasibleJobError(
        f"Job {spec.name!r} needs {spec.describe_cards()} at once on one node{_mem(memory)}, "
        f"and no alive Ray node could ever hold it: {biggest} ({cluster}). Ask for what a node has "
        f"(gpu=, gpu_count=), or add a node with such cards: "
        f"ray start --address=HEAD:6379 $(levers9 ray node-args --unquoted)"
    )


def plan_text(gpu: str, gpu_count: int) -> str:
    """How a job of `gpu_count` cards of type `gpu` would be placed on the Ray cluster now, in one line
    ('4 x RTXPro6000 as 2 nodes x 2: <ip>, <ip>'); the job's own InfeasibleJobError when it could not be."""
    from levers9.launch.spec import build_spec

    spec = build_spec(name="levers9 doctor", gpu=gpu, gpu_count=gpu_count, timeout=None, retries=0, env=None, cpu=None,
                      memory=None, queue_timeout=None, stop_grace=10.0, stream_output=False)  # fmt: skip
    connect()
    nodes = alive_nodes()
    plan = _plan(spec, nodes)
    if plan.gang is not None:
        return f"{plan.gang.describe()} (Ray's placement group picks the nodes when the job starts)"
    return f"{gpu_count} x {plan.gpu_type or 'GPU'} on one node ({len(nodes)} alive node(s)), on loopback as on one machine"


def _plan(spec: JobSpec, nodes: list[Node]) -> TaskRequest:
    """plan_job's task on one node; for a job larger than any node, one node's share of a job split across
    nodes (gang.py); InfeasibleJobError, with a table of the nodes, when it cannot be split either."""
    try:
        return plan_job(spec, nodes)
    except InfeasibleJobError as single:  # larger than any node: split across nodes, or refuse (issue 25)
        if spec.gpu_count < 2:
            raise
        gang = ray_gang.plan_gang(spec, nodes, single, ray_gang.free_by_node())
    num_cpus = spec.cpu if spec.cpu is not None else 0.0
    resources = {resource_name(gang.gpu_type): float(gang.share)} if gang.gpu_type else {}
    return TaskRequest(gang.share, num_cpus, resources, _memory_bytes(spec), gang.gpu_type, gang)


def _memory_bytes(spec: JobSpec) -> int | None:
    return spec.memory_mib * 2**20 if spec.memory_mib is not None else None


def _mem(memory: int | None) -> str:
    return f" and {memory / 2**30:.1f} GiB of memory" if memory is not None else ""


class _RayTask:
    """One submitted Ray task and why this process killed it, if it did."""

    def __init__(self, gen: Any) -> None:
        self.gen = gen
        self.started = False
        self.killed_for: str | None = None
        self.over = threading.Event()  # set once the caller has read the task's last item
        self._lock = threading.Lock()

    def kill(self, reason: str) -> None:
        """ray.cancel(force=True), repeated until the task is over: a cancel that reaches a task while
        Ray is still handing it to a worker can be lost."""
        with self._lock:
            if self.killed_for is not None or (reason == "queue" and self.started):
                return
            self.killed_for = reason
        threading.Thread(target=self._cancel_until_over, name="levers9-ray-cancel", daemon=True).start()

    def _cancel_until_over(self) -> None:
        while not self.over.is_set():
            with contextlib.suppress(Exception):
                ray.cancel(self.gen, force=True)
            self.over.wait(CANCEL_EVERY)


class _RayCell:
    """Runs one cell to completion on Ray: wait its turn, submit, follow, retry, resolve the Future."""

    def __init__(
        self, backend: RayBackend, batch: Batch, cell: Cell, plan: TaskRequest, payload: TaskPayload,
    ) -> None:  # fmt: skip
        self.backend, self.batch, self.cell, self.plan = backend, batch, cell, plan
        self.payload = payload
        self.entry = Entry(plan.shape)  # in the admission queue only from when a lane takes this cell
        self.label = batch.cell_label(cell)
        self.future: Future[Any] = Future()
        self.current: _RayTask | None = None
        self.future.add_done_callback(self._on_done)

    def _on_done(self, future: Future[Any]) -> None:
        if future.cancelled() and self.current is not None:
            self.current.kill("cancel")

    def stopped(self) -> bool:
        return self.batch.cancel.cancelled or self.future.cancelled()

    def take_place(self) -> None:
        """Enter the admission queue as a lane takes this cell (lanes take cells in input order, one at a time)."""
        self.entry = self.backend.admission.enter(self.plan.shape)

    def run(self) -> None:
        """Attempt the cell until it succeeds, fails for good or is cancelled; always resolves the Future."""
        try:
            outcomes.attempt_cell(self.batch, self.cell, self.future, self._attempt, log)
        finally:
            self.backend.admission.leave(self.entry)

    def _attempt(self, attempt: int) -> Any:
        spec = self.batch.spec
        if self.stopped():
            raise Cancelled()
        if attempt > 1:
            self.backend.admission.leave(self.entry)
            self.entry = self.backend.admission.enter(self.plan.shape)  # a retry queues at the back
        deadline = None if spec.queue_timeout is None else time.monotonic() + spec.queue_timeout
        if not self.backend.admission.wait_turn(self.entry, self.stopped, deadline):
            raise Cancelled() if self.stopped() else self._queue_timeout()
        options, payload, pg = self.plan.options(self.label), dataclasses.replace(self.payload, attempt=attempt), None
        if self.plan.gang is not None:  # gang-allocate one bundle per node first, within queue_timeout
            pg = ray_gang.reserve([self.plan.need] * self.plan.gang.nodes, deadline, self.stopped)
            if pg is None:
                raise Cancelled() if self.stopped() else self._queue_timeout()
            options.update(ray_gang.in_bundle(pg, 0))
            gang = GangSlot(pg, self.plan.gang.share, self.plan.gang.nodes, self.plan.gang.gpu_type)
            payload = dataclasses.replace(payload, gang=gang)
        try:
            gen = node_task.options(**options).remote(payload)
        except BaseException:
            if pg is not None:
                ray_gang.release(pg)
            raise
        self.backend.admission.submitted(self.entry)
        current = self.current = _RayTask(gen)
        unregister = self.batch.cancel.on_cancel(lambda: current.kill("cancel"))
        if self.future.cancelled():
            current.kill("cancel")
        timer = None
        if deadline is not None:
            timer = threading.Timer(max(0.0, deadline - time.monotonic()), current.kill, ("queue",))
            timer.daemon = True
            timer.start()
        try:
            return self._follow(current, attempt)
        finally:
            current.over.set()
            unregister()
            if timer is not None:
                timer.cancel()
            if pg is not None:
                ray_gang.release(pg)
            self.current = None

    def _queue_timeout(self) -> JobTimeout:
        spec = self.batch.spec
        return outcomes.queue_timed_out(self.label, spec.queue_timeout, f"{spec.describe_cards()} at once on a Ray node",
                                        f"the cluster has {_free_gpus()} GPU(s) free now")  # fmt: skip

    def _follow(self, current: _RayTask, attempt: int) -> Any:
        """Read the task's items (started, output, end) into events, logs and the outcome."""
        spec, cell = self.batch.spec, self.cell
        info: TaskStarted | None = None
        end: TaskEnded | None = None
        try:
            with outcomes.JobAttempt.begin(self.batch, self.label, cell, attempt) as run:
                for ref in current.gen:
                    item = ray.get(ref)
                    if isinstance(item, TaskStarted):
                        current.started = True
                        info = item
                        self.backend.admission.leave(self.entry)
                        if attempt == 1 and not self.future.set_running_or_notify_cancel():
                            current.kill("cancel")
                            raise Cancelled()
                        where = f"{item.cards or 'no card'} on {item.node}" if self.plan.gang is None else item.node
                        self.batch.events.started(cell, where, attempt)
                    elif isinstance(item, TaskOutput):
                        for stream, text in item.lines:
                            run.output(stream, text)
                    elif isinstance(item, TaskEnded):
                        end = item
        except ray.exceptions.RayError as exc:
            if end is None:
                self._raise_lost(exc, current, run, info)
            log.warning("%s: the Ray task that ran it died after the job had ended (%s: %s); the job's outcome "
                        "stands.", self.label, type(exc).__name__, first_line(str(exc)))  # only its clean-up was cut short
        if end is None:
            if current.killed_for == "cancel" or self.stopped():
                raise Cancelled()
            raise outcomes.ended_without_outcome(run, "", "ended with no outcome from its Ray task", FailureKind.CRASH)
        node = "?" if info is None else info.node
        meta = {} if info is None else {"node": info.node, "node_id": info.node_id, "cards": info.cards, "started": info.time}
        return outcomes.finish(run, end.outcome, spec.timeout, {**meta, "ended": end.time}, node)

    def _raise_lost(self, exc: Exception, current: _RayTask, run: outcomes.JobAttempt, info: TaskStarted | None) -> NoReturn:
        """Raise what the Ray task's end before the job's outcome means: a cancel or queue timeout of this
        process's, levers9's own task code failing, or the task lost (its worker or its node died)."""
        if current.killed_for == "cancel" or self.stopped():
            raise Cancelled() from None
        if current.killed_for == "queue":
            raise self._queue_timeout() from None
        if isinstance(exc, ray.exceptions.TaskCancelledError):
            raise Cancelled() from None
        if isinstance(exc, ray.exceptions.RayTaskError):
            raise exc.as_instanceof_cause() from None  # levers9's own task code failed
        raise outcomes.ended_without_outcome(
            run, "", f"lost the Ray task running it ({type(exc).__name__}: {first_line(str(exc))})", FailureKind.LOST, pid=0 if info is None else info.pid, hint=" The node may have died or run out of memory.",
        ) from exc


def _free_gpus() -> str:
    try:
        return f"{ray.available_resources().get('GPU', 0):g}"
    except Exception:
        return "an unknown number of"


@dataclasses.dataclass(eq=False)
class Entry:
    """One task waiting for its turn, by its shape (what it asks of Ray)."""

    shape: tuple[Any, ...]
    submitted: bool = False  # its task was handed to Ray


class Admission:
    """First come, first served across task shapes, in this process (two callers sharing a cluster are
    ordered by Ray). Ray dispatches queued tasks of different shapes in no fixed order, so a 4-card job
    could wait forever behind a stream of 1-card ones: a task is submitted only when every earlier task
    that has not started yet has the same shape and was submitted already (Ray keeps one shape's queue in
    submission order)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: list[Entry] = []

    def enter(self, shape: tuple[Any, ...]) -> Entry:
        with self._cond:
            entry = Entry(shape)
            self._queue.append(entry)
            return entry

    def wait_turn(self, entry: Entry, stop: Callable[[], bool], deadline: float | None) -> bool:
        """True when `entry` may be submitted; False if `stop()` or the deadline came first."""
        with self._cond:
            while True:
                ahead = self._queue[: self._queue.index(entry)]
                if all(e.shape == entry.shape and e.submitted for e in ahead):
                    return True
                if stop() or (deadline is not None and time.monotonic() >= deadline):
                    return False
                self._cond.wait(0.1)

    def submitted(self, entry: Entry) -> None:
        """`entry`'s task was handed to Ray: the entries behind it may be submitted now."""
        with self._cond:
            entry.submitted = True
            self._cond.notify_all()

    def leave(self, entry: Entry) -> None:
        with self._cond:
            if entry in self._queue:
                self._queue.remove(entry)
                self._cond.notify_all()
