"""Inside a Ray task, on its node: the job process started with the task's cards, supervised, reported back
as the items of a Ray generator. A job across nodes also hosts its control store and agents here
(ray_gang.host)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from collections.abc import Iterator

import ray

from levers9.launch import job_process
from levers9.launch.job_process import TaskEnded, TaskPayload, remove_scratch_dir, scratch_dir
from levers9.launch.ray import gang as ray_gang
from levers9.procs import start
from levers9.procs.supervise import Supervisor
from levers9.procs.watch import Watcher
from levers9.runtime import describe_split

OUTPUT_EVERY = 0.1  # seconds between batches of output lines sent back from a task
ITEM_CHARS = 4 << 20  # of output in one item a task sends back (a long line comes in pieces of about 1 MB)


@dataclasses.dataclass(frozen=True)
class TaskStarted:
    """A Ray task's first item: the job process is running."""

    pid: int
    cards: str  # CUDA_VISIBLE_DEVICES of the job ('' across nodes)
    node: str  # the node's address, or the split across nodes
    node_id: str
    time: float


@dataclasses.dataclass(frozen=True)
class TaskOutput:
    """A batch of the job's output, each (stream, a line with its newline or a piece of a long one without)."""

    lines: list[tuple[str, str]]


def run_on_node(payload: TaskPayload) -> Iterator[TaskStarted | TaskOutput | TaskEnded]:
    """Start the cell as a job process with exactly this task's cards, supervise it, and report on it: one
    TaskStarted, TaskOutput items with batches of lines (at most about ITEM_CHARS each, so the caller never
    holds a long line whole), one TaskEnded with the job's Outcome."""
    payload.use_sys_path()
    func, args, kwargs = payload.call()
    spec = payload.spec
    index, attempt = payload.index, payload.attempt
    ids = [str(i) for i in ray.get_gpu_ids()] if spec.gpu_count else []
    job_dir = scratch_dir("ray", index, attempt)
    lines: collections.deque[tuple[str, str]] = collections.deque()
    watcher = Watcher(on_text=lambda child, stream, text: lines.append((stream, text)))  # long lines in pieces
    node = ray.util.get_node_ip_address()
    hosting = contextlib.ExitStack()  # a job across nodes: its control store and agents (ray_gang.host)
    try:
        gang_host = hosting.enter_context(ray_gang.host(payload, node, spec.stop_grace)) if payload.gang else None
        gang = None if gang_host is None else gang_host.context
        env = job_process.job_env(spec, [])
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids)  # Ray's ids for this task; "" for a CPU job
        context = job_process.task_context(spec, payload.run_id, index, attempt, str(job_dir), ids, payload.gpu_type, gang)
        target = job_process.JobTarget(func, args, kwargs, context)
        method = start.choose()
        shipped = None if method.forks else job_process.ship_target(target)
        child = watcher.add(start.start(target, method=method, shipped=shipped, env=env, name=f"cell {index}"))
        yield TaskStarted(
            pid=child.pid,
            cards=env["CUDA_VISIBLE_DEVICES"] if gang is None else "",
            node=node if gang is None else describe_split(gang.world_size, gang.shares, gang.addresses, context.gpu_type or "GPU"),
            node_id=ray.get_runtime_context().get_node_id(),
            time=time.time(),
        )
        supervisor = Supervisor(watcher, [child], timeout=spec.timeout, grace=spec.stop_grace)
        while not supervisor.step(OUTPUT_EVERY):
            if gang_host is not None:
                gang_host.poll()  # a lost node's agent replaced, when the job process asks
            while lines:
                yield TaskOutput(_drain(lines))
        while lines:
            yield TaskOutput(_drain(lines))
        yield TaskEnded.of(supervisor.outcomes()[0])
    finally:
        watcher.stop(spec.stop_grace)
        watcher.close()
        hosting.close()
        remove_scratch_dir(job_dir)


node_task = ray.remote(run_on_node)


def _drain(lines: collections.deque[tuple[str, str]]) -> list[tuple[str, str]]:
    """The oldest output waiting, at most about ITEM_CHARS of it: the caller holds one item at a time."""
    out, size = [], 0
    while lines and size < ITEM_CHARS:
        out.append(lines.popleft())
        size += len(out[-1][1])
    return out
