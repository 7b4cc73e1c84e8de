"""`distributed.run`: call fn(cfg) on every rank and return what rank 0 returned.

Named `running`, not `run`: a submodule `levers9.distributed.run` would replace the function
`levers9.distributed.run` on the package as soon as it was imported.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import faulthandler
import functools
import inspect
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from types import FrameType, TracebackType
from typing import Any

from levers9.distributed import detect, devices, group, slurm_env, started_ranks
from levers9.distributed.devices import Layout, plan_layout
from levers9.distributed.helpers import device
from levers9.distributed.rank_process import to_cpu
from levers9.distributed.restarts import rank_failed_behind
from levers9.distributed.stalls import board
from levers9.distributed.started_ranks import STOP_GRACE_S
from levers9.errors import ConfigError, RunTimeout
from levers9.procs.start import held_heap
from levers9.retries import RetryPolicy, restart_policy
from levers9.runtime import JobContext, current_job
from levers9.seconds import is_seconds

# What to do instead of each argument that only ranks started here use, under a launcher.
_INSTEAD_UNDER_LAUNCHER = {
    "stall_timeout": "pass timeout= instead (every rank watches itself)",
    "prefix_output": "use the launcher's own output options (torchrun --tee/--redirects)",
    **dict.fromkeys(("max_restarts", "restart_on", "restart_delay"),
                    "let the launcher restart the ranks (torchrun --max-restarts N), or run without a launcher"),
}  # fmt: skip


def run(
    fn: Callable[..., Any],
    cfg: Any = None,
    *,
    nprocs: int | None = None,
    backend: str | None = None,
    timeout: float | None = None,
    stall_timeout: float | None = None,
    start_method: str | None = None,
    prefix_output: bool | None = None,
    disable_quirks: tuple[str, ...] = (),
    stop_grace: float = STOP_GRACE_S,
    max_restarts: int | None = None,
    restart_on: Sequence[str] | None = None,
    restart_delay: float | None = None,
    init_group: bool = True,
) -> Any:
    """Run `fn(cfg)` on every rank and return what rank 0 returned (on every rank, under a launcher).

    Not launched by anything: one process per visible card, or `nprocs` (no card and no `nprocs`:
    run in place as a world of one). Under torchrun / accelerate / SLURM / MPI / levers9: start
    nothing; call fn in this rank. With several ranks, every rank is in the default process group
    when fn starts (`torch.distributed.is_initialized()` is True): one levers9 made, destroyed after
    fn, or one that already existed, left alone. A world of one run in place has no group.

    Args:
        fn: A module-level function (ranks import it by name when they start as fresh interpreters),
            called as `fn(cfg)` on every rank; `fn()` without an argument when `cfg` is None and fn
            takes no parameters.
        cfg: The one argument every rank's fn gets (pickled only when ranks start as fresh interpreters).
        nprocs: How many ranks to start; default one per visible card, else run in place. Under a
            launcher it must equal the launcher's world size (or be left out).
        backend: "nccl" or "gloo"; default nccl when the ranks have cards, else gloo.
        timeout: Seconds; a run (each attempt, with restarts) that takes longer is stopped with
            `RunTimeout` and a report of where every rank was. Works on every path.
        stall_timeout: Seconds; ranks levers9 started are stopped with `StallError` once none issued
            or completed a collective for that long while one waited, naming where each one is.
            Refused under a launcher and in place, and when torch's flight recorder is off.
        start_method: "fork" or "spawn" (fresh interpreters); default: fork where that is safe. Given
            for a world of one, that one rank is started that way instead of running in place.
        prefix_output: Put "[rank N] " before lines from ranks other than 0 (default on).
        disable_quirks: Quirk row ids to switch off (an unknown id is a ConfigError listing the known ones).
        stop_grace: Seconds (default 5) ranks get between SIGTERM and SIGKILL when a sibling failed, on timeout,
            on Ctrl-C, or when this process gets SIGTERM or SIGHUP (then SystemExit(128 + signal)
            is raised here once they are stopped).
        max_restarts: How many times every rank is stopped and all are started again after a
            failure `restart_on` names (default 0, or what `@job(max_restarts=...)` set).
            `restart_count()` tells fn which attempt it is in.
        restart_on: Failure kinds that restart, from "crash", "exit", "exception", "comm", "lost",
            "stall" and "timeout" (default crash, comm, lost, stall; see levers9.retries).
        restart_delay: Seconds between attempts, with no rank running (default 1).
        init_group: True (the default): levers9 joins every rank into the group before fn. False:
            no group; fn makes its own with `init_process_group` (a classic torchrun `main()`;
            without False such a fn fails at once with a ConfigError naming `init_group=False`).

    Returns:
        What fn returned on rank 0.

    Raises:
        ConfigError: A bad argument, before anything starts.
        RankFailed: A rank failed (`RankCrashed`, `RunTimeout`, `StallError`); a rank's own exception
            is raised with its own type instead, with the rank and its traceback in a note.

    `timeout` and `stall_timeout` give the ranks levers9 starts a stack dump on SIGUSR1 (and, for
    stalls, a flight-recorder sampler thread) for their reports; without them levers9 installs
    nothing in a rank.
    """
    options = RunOptions(nprocs=nprocs, backend=backend, timeout=timeout, stall_timeout=stall_timeout,
                         start_method=start_method, prefix_output=prefix_output, disable_quirks=disable_quirks,
                         stop_grace=stop_grace, max_restarts=max_restarts, restart_on=restart_on,
                         restart_delay=restart_delay, init_group=init_group)  # fmt: skip
    try:
        return run_with(fn, cfg, options)
    except Exception as exc:
        if rank_failed_behind(exc) is None:
            raise
        # a rank's failure is raised from the caller's line: levers9's layers that started and watched the ranks are no part of it
        raise exc.with_traceback(None) from exc.__cause__


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """`run`'s keywords as one value, the way the caller gave them (None: the default), checked once."""

    nprocs: int | None = None
    backend: str | None = None
    timeout: float | None = None
    stall_timeout: float | None = None
    start_method: str | None = None
    prefix_output: bool | None = None
    disable_quirks: tuple[str, ...] = ()
    stop_grace: float = STOP_GRACE_S
    max_restarts: int | None = None
    restart_on: Sequence[str] | None = None
    restart_delay: float | None = None
    init_group: bool = True
    caller: str = "distributed.run"  # the caller's name in messages ("levers9 run")
    agent: Any = None  # levers9 run's TorchrunAgent: torchrun's files, role, prefixes and port for ranks started here

    def check(self) -> RetryPolicy:
        """ConfigError for the first bad keyword, before anything starts; the restart policy they make."""
        for name in ("timeout", "stall_timeout", "stop_grace"):
            _check_seconds(name, getattr(self, name))
        if not isinstance(self.init_group, bool):
            raise ConfigError(f"init_group={self.init_group!r}; expected True (levers9 joins the group before fn) or "
                              f"False (fn calls init_process_group itself).")  # fmt: skip
        from levers9.distributed.hardware import quirks  # loads on use, not with levers9.distributed

        quirks.check_quirk_ids(self.disable_quirks)
        if self.init_group:
            group.pg_timeout()  # a bad LEVERS9_PG_TIMEOUT is refused here, not in every rank
        return restart_policy(self.max_restarts, self.restart_on, self.restart_delay)

    def for_started_ranks_only(self) -> dict[str, Any]:
        """The keywords that mean something only for ranks this call starts itself."""
        names = ("stall_timeout", "start_method", "prefix_output", "max_restarts", "restart_on", "restart_delay")
        return {name: getattr(self, name) for name in names}

    @property
    def diagnostics(self) -> bool:
        """The ranks get reports of where each one is: timeout= or stall_timeout= asked for them."""
        return self.timeout is not None or self.stall_timeout is not None

    @property
    def prefix(self) -> bool:
        return self.prefix_output is None or bool(self.prefix_output)


def run_with(fn: Callable[..., Any], cfg: Any, options: RunOptions) -> Any:
    """`run(fn, cfg, ...)` with its keywords as one value: picks the path (under a launcher, in place, ranks
    started here, across nodes). Until fn runs in this process, or while this process only starts and watches
    ranks, its objects are held out of its garbage collector (procs/start.py, held_heap)."""
    if not callable(fn):
        raise ConfigError(f"distributed.run needs a function to call on every rank; got {type(fn).__name__} {fn!r}.")
    import torch  # noqa: F401 - every path needs it (levers9 run's caller had not imported it): held with the rest

    with contextlib.ExitStack() as held:
        held.enter_context(held_heap())
        policy = options.check()
        slurm_env.check_started_by_srun(os.environ)  # a job script's own process, where srun was meant
        call = fn if cfg is None and _takes_no_arguments(fn) else functools.partial(fn, cfg)
        info = detect.launch_info()
        if info.launcher != "single" or detect.live_group() is not None:
            held.close()  # fn runs in this process, with its collector as the caller left it
            return _run_under_launcher(call, info, options)
        layout = plan_layout(options.nprocs, options.backend)
        job = current_job()
        if options.max_restarts is None and job is not None:
            policy = dataclasses.replace(policy, max_retries=job.max_restarts)  # @job(max_restarts=...)
        if (layout.nprocs == 1 and not policy.max_retries and options.start_method is None and options.agent is None
                and (job is None or job.gang is None)):  # fmt: skip
            # a restartable world of one, one asked to start a certain way, or levers9 run's, runs as a started rank
            held.close()
            return _run_in_place(call, layout, options)
        if options.stall_timeout is None and job is not None:
            options = dataclasses.replace(options, stall_timeout=job.stall_timeout)  # @job(stall_timeout=...)
        if job is not None and job.gang is not None:  # a job holding cards on several Ray nodes (issue 25)
            return _run_across_nodes(fn, cfg, call, layout, options, policy, job)
        return _run_ranks_here(fn, cfg, call, layout, options, policy)


def _run_under_launcher(call: Callable[[], Any], info: detect.LaunchInfo, options: RunOptions) -> Any:
    """fn in this rank of a launcher's world (or of a group the user made), quirks applied, in the group
    (joined now unless `init_group` is False); rank 0's value, on every rank."""
    if options.nprocs is not None and options.nprocs != info.world_size:
        raise ConfigError(
            f"nprocs={options.nprocs} but this process is already one of {info.world_size} rank(s) under {info.launcher}; "
            f"the launcher decides how many ranks run. Drop nprocs=, or launch {options.nprocs} ranks "
            f"(e.g. --nproc-per-node {options.nprocs})."
        )
    _refuse_started_ranks_only(f"under {info.launcher}", **options.for_started_ranks_only())
    backend = options.backend or devices.default_backend()
    from levers9.distributed.hardware import quirks  # loads on use, not with levers9.distributed

    quirks.apply_quirks(local_world_size=info.local_world_size, backend=backend, is_main=detect.rank() == 0,
                        disabled=options.disable_quirks)  # fmt: skip
    with SelfTimer(options.timeout, f"rank {detect.rank()} of distributed.run", under_launcher=True):
        with group.joined(backend) if options.init_group else contextlib.nullcontext():
            result = call()
            if detect.live_group() is not None:
                return _from_rank0(result)
        return _from_rank0_without_group(result, backend)


def _run_in_place(call: Callable[[], Any], layout: Layout, options: RunOptions) -> Any:
    """fn in this process as a world of one, quirks applied; its value."""
    _refuse_started_ranks_only("in place", stall_timeout=options.stall_timeout)
    from levers9.distributed.hardware import quirks  # loads on use, not with levers9.distributed

    quirks.apply_quirks(local_world_size=1, backend=layout.backend, is_main=True, disabled=options.disable_quirks)
    with SelfTimer(options.timeout, "distributed.run (in place, a world of one)", under_launcher=False):
        return call()


def _run_ranks_here(fn: Callable[..., Any], cfg: Any, call: Callable[..., Any], layout: Layout, options: RunOptions,
                    policy: RetryPolicy) -> Any:  # fmt: skip
    """One process per rank, started here (again after each failure the policy restarts); rank 0's value."""
    method = started_ranks.start_method(options.start_method, options.stall_timeout, layout.backend)
    env = started_ranks.ranks_env_with_diagnostics(layout, options.disable_quirks, options.diagnostics)
    shipped = None if method.forks else started_ranks.shipped_call(fn, cfg, call, method)
    ranks = started_ranks.StartedRanks(call, shipped, layout, env, method, options.timeout, options.stall_timeout,
                                       options.prefix, options.stop_grace, make_group=options.init_group,
                                       caller=options.caller, agent=options.agent)  # fmt: skip
    return started_ranks.start_attempts(ranks, policy)


def _run_across_nodes(fn: Callable[..., Any], cfg: Any, call: Callable[..., Any], layout: Layout, options: RunOptions,
                      policy: RetryPolicy, job: JobContext) -> Any:  # fmt: skip
    """distributed.run inside a job that holds cards on several Ray nodes: see levers9.distributed.nodes."""
    from levers9.distributed import nodes  # the code across nodes loads only for a job that spans nodes

    gang = job.gang
    assert gang is not None
    nodes.refuse_across_nodes(options.nprocs, gang)
    if options.stall_timeout is not None:
        board.require(layout.backend)
    method = started_ranks.start_method(options.start_method, options.stall_timeout, layout.backend)
    env = started_ranks.ranks_env_with_diagnostics(layout, options.disable_quirks, options.diagnostics)
    env = {k: v for k, v in env.items() if k not in nodes.SOCKET_VARS}
    run = nodes.GangRun(call, started_ranks.shipped_call(fn, cfg, call, method), layout.backend, env, method, options.timeout,
                        options.stall_timeout, options.stop_grace, options.init_group, options.prefix)  # fmt: skip
    return nodes.run_across_nodes(run, policy, gang)


def _check_seconds(name: str, value: Any) -> None:
    grace = name == "stop_grace"  # may be 0, never None; the others may be None (no limit)
    if value is None and not grace:
        return
    if not is_seconds(value, zero_ok=grace):
        expected = "a finite number of seconds >= 0" if grace else "a finite positive number of seconds, or None for no limit"
        raise ConfigError(f"{name}={value!r}; expected {expected}. Pass e.g. {name}=30.")


def _refuse_started_ranks_only(where: str, **given: Any) -> None:
    """Arguments that only mean something for ranks this call starts: refused, not ignored, `where` it starts none."""
    in_place = where == "in place"
    for name, value in given.items():
        if value is None:
            continue
        under = "fn runs in place, as a world of one" if in_place else f"this process is already a rank, {where}"
        instead = "pass nprocs=2 or more to start ranks, or drop it" if in_place else _INSTEAD_UNDER_LAUNCHER.get(name, "drop it")
        raise ConfigError(
            f"{name}={value!r} applies only to ranks distributed.run starts itself, and here it starts none: "
            f"{under}. Expected it unset here; {instead}."
        )


def _takes_no_arguments(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    return not any(p.kind in positional for p in params)


def _from_rank0(result: Any) -> Any:
    """Rank 0's `result` on every rank, through the live group."""
    import torch.distributed as td

    box = [to_cpu(result) if td.get_rank() == 0 else None]
    td.broadcast_object_list(box, src=0, device=device() if td.get_backend() == "nccl" else None)
    return box[0]


def _from_rank0_without_group(result: Any, backend: str) -> Any:
    """Rank 0's `result` on every rank after fn destroyed its own group: through a group made for it alone."""
    if detect.launch_info().world_size == 1:
        return result
    group.join_launcher_group(detect.launch_info(), backend)  # makes one: no group is live here
    try:
        return _from_rank0(result)
    finally:
        group.destroy_own_group()


EXIT_AFTER_S = 5.0  # a rank under a launcher that has not unwound this long after its timeout exits
TIMEOUT_EXIT_CODE = 124  # as timeout(1)


class SelfTimer:
    """`timeout=` for code that runs in this process (a rank under a launcher, a world of one in place), which no
    parent of levers9's watches: RunTimeout in the calling thread once `seconds` have passed (no-op for None).

    It is raised at the thread's next Python instruction (a SIGALRM first interrupts a blocking system call when
    it is the main thread). A rank under a launcher stuck in native code (a collective that never returns) prints
    its stacks and exits with code 124 a few seconds later, so the launcher stops the other ranks; a process
    running in place is the user's own and is never killed.
    """

    def __init__(self, seconds: float | None, what: str, *, under_launcher: bool) -> None:
        self.seconds, self.what, self.under_launcher = seconds, what, under_launcher
        self._done = threading.Event()
        self._thread_id = threading.get_ident()
        self._old_handler: object = None

    def __enter__(self) -> SelfTimer:
        if self.seconds is None:
            return self
        if threading.current_thread() is threading.main_thread():
            self._old_handler = signal.signal(signal.SIGALRM, self._on_alarm)
        threading.Thread(target=self._watch, name="levers9-self-timer", daemon=True).start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self._done.set()
        if self._old_handler is not None:
            signal.signal(signal.SIGALRM, self._old_handler)  # type: ignore[arg-type]
        if et is RunTimeout and not str(ev):  # raised bare by PyThreadState_SetAsyncExc
            raise self.error() from None

    def error(self) -> RunTimeout:
        return RunTimeout(
            f"{self.what} timed out: still running after {self.seconds:g} s (timeout={self.seconds:g}). Expected "
            f"fn to finish within the timeout; pass a larger timeout=, or None for no limit."
        )

    def _on_alarm(self, signum: int, frame: FrameType | None) -> None:
        if not self._done.is_set():
            raise self.error()

    def _watch(self) -> None:
        assert self.seconds is not None
        if self._done.wait(self.seconds):
            return
        if self._old_handler is not None:
            signal.pthread_kill(self._thread_id, signal.SIGALRM)
        else:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._thread_id), ctypes.py_object(RunTimeout))
        if not self.under_launcher or self._done.wait(EXIT_AFTER_S):
            return
        print(f"levers9: {self.error()} It did not unwind within {EXIT_AFTER_S:g} s; its stacks:", file=sys.stderr)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(TIMEOUT_EXIT_CODE)
