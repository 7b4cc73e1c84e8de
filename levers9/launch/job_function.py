"""`@job`: a function that can also run as jobs on this machine's cards (or a Ray cluster).

    @job(gpu="RTXPro6000", gpu_count=1, timeout=3600)
    def cell(lora_r: int, lr: float) -> dict: ...

    cell(8, 1e-4)                           # a plain call in this process
    cell.remote(8, 1e-4)                    # one job on its own card(s): the result, or its exception
    fut = cell.spawn(8, 1e-4)               # a concurrent.futures.Future
    for r in cell.map([(8, 1e-4), (16, 1e-4)]): ...   # each cell its own job, input order
    for i, r in cell.map(grid, order="completed", resume=True): ...   # as cells finish; reuse earlier results

Every call checks its arguments, then reads the workspace settings afresh (card cap, multi-GPU
switch), then asks the backend whether the job could ever fit, all before anything starts.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Generic, Literal, ParamSpec, TypeVar, overload

from levers9.errors import JobConfigError
from levers9.launch.backend import (
    Backend,
    Batch,
    CancelToken,
    TeeEvents,
    backend_name,
    get_backend,
    new_run_id,
)
from levers9.launch.cells import Cell, check_cell, make_cells
from levers9.launch.map_results import RECORD_WAIT, Completed, MapResults, wait_done
from levers9.launch.progress import Mode, Reporter, choose_mode
from levers9.launch.run_folder import RunRecord
from levers9.launch.settings import load_settings
from levers9.launch.spec import JobSpec, build_spec, check_policy
from levers9.procs.watch import exit_on_terminate
from levers9.retries import RetryPolicy

P = ParamSpec("P")
R = TypeVar("R")

log = logging.getLogger("levers9.launch")


class JobFunction(Generic[P, R]):
    """A function plus what its jobs ask for. Calling it runs it here; .remote/.spawn/.map run jobs."""

    def __init__(self, func: Callable[P, R], spec: JobSpec, backend: str | None) -> None:
        self.func = func
        self.spec = spec
        self.backend = backend
        functools.update_wrapper(self, func)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Run the function in this process, as if it were not decorated."""
        return self.func(*args, **kwargs)

    def remote(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Run one job and return its result, or raise its exception; cancels the job if interrupted."""
        cell = Cell(0, tuple(args), dict(kwargs))
        check_cell(self.func, cell, label=f"{self.spec.name}{cell.describe()}")
        with exit_on_terminate():  # from before the job starts: a SIGTERM once it runs always gives it its grace
            futures, cancel, _reporter, record = self._submit([cell], label="")
            try:
                return wait_done(futures[0]).result()
            finally:
                cancel.cancel()
                with contextlib.suppress(Exception):  # interrupted: the job is stopped (stop_grace) before this returns
                    wait_done(futures[0]).exception()
                # The future wakes this thread before its done-callback closes the run's record: wait for that,
                # so the record is whole, and any warning about what a full disk lost is said, before we return.
                record.closed.wait(RECORD_WAIT)

    def spawn(self, *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        """Start one job and return a `concurrent.futures.Future` for its value or exception (cancel() works
        while it queues)."""
        cell = Cell(0, tuple(args), dict(kwargs))
        check_cell(self.func, cell, label=f"{self.spec.name}{cell.describe()}")
        futures, _cancel, _reporter, _record = self._submit([cell], label="")
        return futures[0]

    @overload
    def map(
        self,
        cells: Iterable[Any],
        *,
        return_exceptions: bool = ...,
        kwargs: Mapping[str, Any] | None = ...,
        order: Literal["input"] = ...,
        resume: bool = ...,
        progress: bool = ...,
    ) -> MapResults[R]: ...

    @overload
    def map(
        self,
        cells: Iterable[Any],
        *,
        return_exceptions: bool = ...,
        kwargs: Mapping[str, Any] | None = ...,
        order: Literal["completed"],
        resume: bool = ...,
        progress: bool = ...,
    ) -> MapResults[Completed[R]]: ...

    def map(
        self,
        cells: Iterable[Any],
        *,
        return_exceptions: bool = False,
        kwargs: Mapping[str, Any] | None = None,
        order: str = "input",
        resume: bool = False,
        progress: bool = True,
    ) -> MapResults[Any]:
        """Run each cell as its own job, as many at once as there are cards; iterate the results.

        Every cell is checked before any starts. The first failure raises (with the cell's index
        and arguments in a note) and cancels the rest. Leaving the loop early (break, close,
        garbage collection) cancels the cells not yet finished and kills the running ones.

        Args:
            cells: One entry per job: a tuple is positional arguments, a dict keyword arguments,
                anything else one argument.
            return_exceptions: Put a failed cell's exception in its slot instead of raising it.
            kwargs: Keyword arguments added to every cell.
            order: "input" (the default) yields values in input order; "completed" yields
                `Completed(index, value)` pairs as cells finish (`for i, value in ...`; i indexes
                the inputs).
            resume: Reuse the stored result of every cell that succeeded before with the same
                function source and the same arguments, and run only the others.
            progress: False hides the status table (or, when stderr is not a terminal, the line
                per state change).

        Returns:
            A `MapResults` to iterate (its `run_id` names the run folder for `levers9 runs show`).

        Raises:
            JobConfigError: A bad cell or argument, before any cell starts.
        """
        if order not in ORDERS:
            raise JobConfigError(
                f"order={order!r} is not a result order; expected one of: {', '.join(map(repr, ORDERS))} "
                f"(input order, or as cells finish)."
            )
        checked = make_cells(self.func, cells, kwargs=kwargs)
        if not checked:
            return MapResults([], [], CancelToken(), return_exceptions, order, None, None)
        mode = choose_mode(progress, len(checked), sys.stderr)
        futures, cancel, reporter, record = self._submit(
            checked, label=self.spec.name, mode=mode, resume=resume
        )
        return MapResults(checked, futures, cancel, return_exceptions, order, reporter, record)

    def _submit(
        self, cells: Sequence[Cell], *, label: str, mode: Mode = "off", resume: bool = False
    ) -> tuple[list[Future[Any]], CancelToken, Reporter, RunRecord]:
        """Check the policy, open the run's record, reuse stored results (resume), submit the rest."""
        check_policy(self.spec, load_settings())
        name = backend_name(self.backend)
        backend: Backend = get_backend(name)
        run_id = new_run_id(self.spec.name)
        record = RunRecord(run_id, name=self.spec.name, backend=name, func=self.func, cells=cells)
        reporter = Reporter(self.spec.name, cells, mode=mode, stream_output=self.spec.stream_output)
        try:
            record.claim(wait=resume)
            reused = record.reuse(cells) if resume else {}
            todo = [cell for cell in cells if cell.index not in reused]
            batch = Batch(
                spec=self.spec,
                func=self.func,
                cells=todo,
                folder=record.folder,
                events=TeeEvents(reporter, record),
                label=label,
            )
            reporter.batch = batch
            for cell in cells:
                if cell.index in reused:
                    reporter.reused_cell(cell)
            if resume:
                reporter.note(f"reused {len(reused)} of {len(cells)} cells from earlier runs ({record.path.name})")
            submitted = iter(backend.submit(batch) if todo else [])
        except BaseException:
            reporter.close()
            record.discard()  # refused (infeasible, not shippable, ...): bad input leaves nothing behind
            raise
        futures: list[Future[Any]] = []
        try:
            for cell in cells:
                if cell.index in reused:
                    future: Future[Any] = Future()
                    future.set_running_or_notify_cancel()
                    future.set_result(reused[cell.index])
                else:
                    future = next(submitted)
                    future.add_done_callback(functools.partial(record.store, cell))
                futures.append(future)
            record.close_when_done(futures)
        except BaseException:  # a SIGTERM (SystemExit) or Ctrl-C here: no caller will cancel what started
            batch.cancel.cancel()
            raise
        return futures, batch.cancel, reporter, record

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle by reference when importable (module.qualname), else by value."""
        module, qualname = self.func.__module__, self.func.__qualname__
        if module != "__main__" and "<locals>" not in qualname:
            return (_resolve_job, (module, qualname))
        return (JobFunction, (self.func, self.spec, self.backend))

    def __repr__(self) -> str:
        return f"<job {self.spec.name} ({self.spec.describe_cards()})>"


def _resolve_job(module: str, qualname: str) -> Any:
    import importlib

    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


ORDERS = ("input", "completed")


@overload
def job(func: Callable[P, R], /) -> JobFunction[P, R]: ...


@overload
def job(
    func: None = None,
    /,
    *,
    gpu: str | Sequence[str] | None = None,
    gpu_count: int | None = None,
    timeout: float | None = None,
    retries: int | RetryPolicy = 0,
    env: Mapping[str, str] | None = None,
    cpu: float | str | None = None,
    memory: int | str | None = None,
    name: str | None = None,
    queue_timeout: float | None = None,
    stop_grace: float = 10.0,
    stream_output: bool = True,
    stall_timeout: float | None = None,
    max_restarts: int = 0,
    backend: str | None = None,
    **backend_options: Mapping[str, Any],
) -> Callable[[Callable[P, R]], JobFunction[P, R]]: ...


def job(
    func: Callable[P, R] | None = None,
    /,
    *,
    gpu: str | Sequence[str] | None = None,
    gpu_count: int | None = None,
    timeout: float | None = None,
    retries: int | RetryPolicy = 0,
    env: Mapping[str, str] | None = None,
    cpu: float | str | None = None,
    memory: int | str | None = None,
    name: str | None = None,
    queue_timeout: float | None = None,
    stop_grace: float = 10.0,
    stream_output: bool = True,
    stall_timeout: float | None = None,
    max_restarts: int = 0,
    backend: str | None = None,
    **backend_options: Mapping[str, Any],
) -> JobFunction[P, R] | Callable[[Callable[P, R]], JobFunction[P, R]]:
    """Make `func` runnable as jobs. Arguments are checked now; JobConfigError names the bad one.

    Args:
        func: The function (when used as `@job` without arguments).
        gpu: A type ('RTXPro6000', 'H100', 'A100-80', 'any'), a list in order of preference, or 'H100:8'
            (type and count); None with gpu_count=0 (the default) is a CPU job, which gets no card.
        gpu_count: cards held by one job at the same moment (default 1 when gpu is set).
        timeout: seconds per attempt, from the job's start; None (the default) for no limit. The job's
            whole process group is killed and its cards freed when it runs out.
        retries: re-runs of a crashed or timed-out job (an int, or Retries(...) for backoff and which
            failures count). Default 0: a local crash rarely goes away by itself, and re-running an
            8-card training silently is expensive.
        env: variables set in the job process (str values; CUDA_VISIBLE_DEVICES and LEVERS9_* are refused).
        cpu: CPU cores (a number, or '500m'); advisory on this machine (sets OMP_NUM_THREADS /
            MKL_NUM_THREADS), a request on a cluster.
        memory: MiB as an int, or a size such as '64Gi' or '512Mi'; advisory on this machine, a
            request on a cluster.
        name: for logs and messages (default: the function's qualified name).
        queue_timeout: seconds a job may wait for free cards before JobTimeout, counted from when it is
            next in line in its sweep; None waits as long as needed.
        stop_grace: seconds between SIGTERM and SIGKILL when a job is timed out or cancelled (default 10):
            time for its own SIGTERM handler to save a checkpoint. Its whole process tree is killed after.
        stream_output: copy each job's output to this process, prefixed with its cell (it is logged to a
            file under the run folder, and its last line shown in the status table, either way).
        stall_timeout: seconds; distributed.run inside the job stops and names the stalled ranks when no
            rank issued or completed a collective for that long while at least one waited for one.
        max_restarts: how often distributed.run inside the job stops every rank and starts them all again
            after a crash, a lost peer or a stall, on the same cards (fn resumes from its own checkpoint;
            see dist.restart_count()). Distinct from retries=, which re-runs the whole job from scratch.
        backend: 'local' (this machine; the default), 'ray' or 'slurm'; $LEVERS9_BACKEND sets the default.
        **backend_options: a backend's own options, under its name. slurm={'partition', 'account', 'qos',
            'sbatch' (more #SBATCH options as one string), 'max_running' (a map's concurrency limit), 'detach',
            'requeue'} for backend='slurm'; the workspace's [slurm] table gives defaults.

    Returns:
        A `JobFunction`: calling it runs the function here; `.remote`, `.spawn` and `.map` run jobs.

    Raises:
        JobConfigError: A bad argument, at decoration time.
    """

    def decorate(fn: Callable[P, R]) -> JobFunction[P, R]:
        _check_callable(fn)
        spec = build_spec(
            name=name or str(getattr(fn, "__qualname__", repr(fn))),
            gpu=gpu,
            gpu_count=gpu_count,
            timeout=timeout,
            retries=retries,
            env=env,
            cpu=cpu,
            memory=memory,
            queue_timeout=queue_timeout,
            stop_grace=stop_grace,
            stream_output=stream_output,
            stall_timeout=stall_timeout,
            max_restarts=max_restarts,
            backend_options=backend_options,
        )
        if backend is not None:
            backend_name(backend)
        return JobFunction(fn, spec, backend)

    if func is not None:
        return decorate(func)
    return decorate


def _check_callable(fn: Any) -> None:
    if isinstance(fn, JobFunction):
        raise JobConfigError(f"{fn.spec.name} is already a job; apply @job once.")
    if inspect.isclass(fn):
        raise JobConfigError(
            f"@job decorates functions, not classes ({fn.__qualname__}). Decorate a function that builds and uses it."
        )
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        raise JobConfigError(
            f"@job does not run async functions yet ({fn.__qualname__}); make it a plain def."
        )
    if inspect.isgeneratorfunction(fn):
        raise JobConfigError(
            f"@job functions return one result; {fn.__qualname__} is a generator. Return a list instead."
        )
    if not callable(fn):
        raise JobConfigError(f"@job needs a function, got {type(fn).__name__}.")
