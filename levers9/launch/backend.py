"""The seam between the job layer and whatever runs jobs: one method, `submit(batch) -> futures`.

job_function.py does everything that is the same for every backend (argument checks, the workspace cap and
switch, result ordering, cancellation when a map is left, progress, the run's record). A backend
receives a Batch of already-checked cells with the run folder the record made (each attempt's logs
and meta.json go there, what a full disk cost goes to its loss record), checks that its machines
could ever fit the job (InfeasibleJobError before starting anything), starts each cell when cards
are free, and resolves one Future per cell with the result or the job's exception. It watches
`batch.cancel` and stops queued and running cells when it is set. The job process itself runs a
job_process.JobTarget, which is shared by every backend.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from levers9.errors import JobConfigError
from levers9.launch.cells import Cell
from levers9.launch.run_folder import RunFolder
from levers9.launch.spec import JobSpec


class CancelToken:
    """Set once when the caller gives up on a batch; callbacks run at once (or now, if already set)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def cancel(self) -> None:
        """Mark the batch cancelled and run every registered callback."""
        with self._lock:
            if self._event.is_set():
                return
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def on_cancel(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Run `callback` on cancel; returns a function that unregisters it."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(callback)
                return lambda: self._remove(callback)
        callback()
        return lambda: None

    def _remove(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep up to `timeout` s, waking early (True) if cancelled."""
        return self._event.wait(timeout)


class Events(Protocol):
    """What a backend reports while a batch runs (status display, output streaming, the run record)."""

    def waiting(self, cell: Cell, why: str) -> None: ...
    def started(self, cell: Cell, cards: str, attempt: int) -> None: ...
    def retrying(self, cell: Cell, attempt: int, reason: str) -> None: ...
    def finished(self, cell: Cell, ok: bool, error: BaseException | None = None) -> None: ...
    def output(self, cell: Cell, stream: str, text: str) -> None: ...  # a line with its "\n", or a piece of a long one


class TeeEvents:
    """Passes every event to each of `targets`, in order (with none, an Events that ignores everything)."""

    def __init__(self, *targets: Events) -> None:
        self.targets = targets

    def _each(self, tell: Callable[[Events], None]) -> None:
        for target in self.targets:
            tell(target)

    def waiting(self, cell: Cell, why: str) -> None:
        self._each(lambda target: target.waiting(cell, why))

    def started(self, cell: Cell, cards: str, attempt: int) -> None:
        self._each(lambda target: target.started(cell, cards, attempt))

    def retrying(self, cell: Cell, attempt: int, reason: str) -> None:
        self._each(lambda target: target.retrying(cell, attempt, reason))

    def finished(self, cell: Cell, ok: bool, error: BaseException | None = None) -> None:
        self._each(lambda target: target.finished(cell, ok, error))

    def output(self, cell: Cell, stream: str, text: str) -> None:
        self._each(lambda target: target.output(cell, stream, text))


@dataclasses.dataclass
class Batch:
    """Checked cells of one function and one spec, submitted together (a map, or one remote/spawn call)."""

    spec: JobSpec
    func: Callable[..., Any]  # the plain function (never the JobFunction wrapper)
    cells: Sequence[Cell]
    folder: RunFolder  # made once, by the batch's RunRecord: the backend writes each attempt's logs there
    cancel: CancelToken = dataclasses.field(default_factory=CancelToken)
    events: Events = dataclasses.field(default_factory=TeeEvents)
    label: str = ""  # "train #3" is label + index; "" means the spec's name

    @property
    def run_id(self) -> str:
        return self.folder.path.name

    def cell_label(self, cell: Cell) -> str:
        """How messages and output prefixes name a cell: 'train #3', or 'train' for a single call."""
        base = self.label or self.spec.name
        return f"{base} #{cell.index}" if len(self.cells) > 1 or self.label else base


class Backend(Protocol):
    """Runs batches of jobs. One method; everything else is shared."""

    def submit(self, batch: Batch) -> list[Future[Any]]:
        """Start (or queue) every cell; one Future per cell, in order. InfeasibleJobError before starting any."""
        ...


# name -> "module:attribute" of a zero-argument factory; imported only when used.
BACKENDS: dict[str, str] = {
    "local": "levers9.launch.local:LocalBackend",
    "ray": "levers9.launch.ray.backend:RayBackend",
    "slurm": "levers9.launch.slurm.backend:SlurmBackend",
}
# One backend of each kind per process: the Ray one holds its connection and its admission queue.
_instances: dict[str, Backend] = {}
_instances_lock = threading.Lock()


def backend_name(requested: str | None) -> str:
    """The backend to use: @job(backend=...), else $LEVERS9_BACKEND, else 'local'."""
    name = requested or os.environ.get("LEVERS9_BACKEND") or "local"
    if name not in BACKENDS:
        raise JobConfigError(
            f"Unknown backend {name!r} (from {'backend=' if requested else 'LEVERS9_BACKEND'}). "
            f"Expected one of: {', '.join(sorted(BACKENDS))}."
        )
    return name


def get_backend(name: str) -> Backend:
    """The process-wide instance of backend `name`, created on first use."""
    with _instances_lock:
        if name not in _instances:
            module_name, _, attr = BACKENDS[name].partition(":")
            try:
                module = importlib.import_module(module_name)
            except ImportError as exc:
                raise JobConfigError(
                    f"backend={name!r} needs {exc.name or module_name}, which is not installed. "
                    f"Install it with: pip install 'levers9[{name}]'"
                ) from exc
            _instances[name] = getattr(module, attr)()
        return _instances[name]


def new_run_id(name: str) -> str:
    """A run's folder name: the time, the job's name and a short random part."""
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)[:40]
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{safe}-{uuid.uuid4().hex[:6]}"


# Both backends' dispatcher: a batch's cells run in input order on a fixed number of lanes (threads).
#
# A lane takes the next cell, which takes its place in the backend's queue before the next lane can take one
# (so cells queue in input order, whichever lane thread runs first), runs it to its end (waiting for cards,
# attempts, retries), then takes the next. With as many lanes as the batch could ever run at once, threads
# and open descriptors depend on the machine or the cluster, never on the number of cells: a cell queued
# behind the lanes holds nothing, and a cancelled batch cancels its queued cells at once instead of one by
# one.


class CellRunner(Protocol):
    """One cell's work: `take_place()` when a lane takes it (never raises), then `run()`, which resolves `future`
    whatever happens."""

    future: Future[Any]

    def take_place(self) -> None: ...

    def run(self) -> None: ...


def dispatch(batch: Batch, runners: Sequence[CellRunner], lanes: int) -> None:
    """Start min(lanes, cells) lane threads that run `runners` in order; returns at once."""
    queue: collections.deque[CellRunner] = collections.deque(runners)
    lock = threading.Lock()

    def next_runner() -> CellRunner | None:
        with lock:
            if not queue:
                return None
            runner = queue.popleft()
            runner.take_place()  # under the lock: places are taken in input order
            return runner

    def lane() -> None:
        while (runner := next_runner()) is not None:
            runner.run()

    def cancel_queued() -> None:
        with lock:
            queued = list(queue)
        for runner in queued:
            runner.future.cancel()

    batch.cancel.on_cancel(cancel_queued)
    name = batch.label or batch.spec.name
    for index in range(max(1, min(lanes, len(runners)))):
        threading.Thread(target=lane, name=f"levers9-{name}-lane{index}", daemon=True).start()
