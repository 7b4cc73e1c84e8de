"""`distributed.run`: call fn(cfg) on every rank and return what rank 0 returned.

Under a launcher, or with one process, fn runs in this process. Otherwise one process per card (or
`nprocs`) starts through levers9.procs: forked where that is safe (no second `import torch`), fresh
interpreters with fn and cfg shipped by value where it is not. The ranks meet on a rendezvous store
this process hosts on a loopback port it bound itself (nothing reachable from other hosts); the
first failure stops the rest and is raised here with the rank, its exit code or signal, and its own
traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from levers9.context import JobContext, current_job
from levers9.distributed import detect, group, restarts, slurm_env, stalls, world
from levers9.distributed.layout import Layout, plan_layout
from levers9.distributed.rank_process import to_cpu
from levers9.distributed.rank_set import RankOutput, RankSet, Share, rank_vars
from levers9.distributed.root_failure import raise_root, rank_failure
from levers9.distributed.self_timer import SelfTimer
from levers9.distributed.stalls import flight_recorder
from levers9.distributed.store_server import hosted_store
from levers9.errors import (
    ConfigError,
    NotShippableError,
    RankFailed,
    RunTimeout,
    StallError,
)
from levers9.procs import start
from levers9.procs.failure import ship, unpicklable_part, unship_value
from levers9.procs.outcome import Outcome, StopReason, root_cause
from levers9.procs.watch import exit_on_terminate
from levers9.retries import RetryPolicy, restart_policy
from levers9.seconds import is_seconds

STOP_GRACE_S = 5.0  # default stop_grace: SIGTERM, then SIGKILL after this long
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
    run in place as a world of one). Under torchrun / accelerate / SLURM / MPI / levers9: spawn
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
        start_method: "fork" or "spawn" (fresh interpreters); default: fork where that is safe.
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
    return run_with(fn, cfg, options)


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """`run`'s keywords as one value, the way the caller gave them (None: the default); `run_with` checks
    them once, and each path reads what it needs from here."""

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

    def check(self) -> RetryPolicy:
        """ConfigError for the first bad keyword, before anything starts; the restart policy they make."""
        for name in ("timeout", "stall_timeout", "stop_grace"):
            _check_seconds(name, getattr(self, name), allow_zero=name == "stop_grace")
        if not isinstance(self.init_group, bool):
            raise ConfigError(f"init_group={self.init_group!r}; expected True (levers9 joins the group before fn) or "
                              f"False (fn calls init_process_group itself).")  # fmt: skip
        from levers9.distributed.hardware import quirks  # imported on use: `import levers9` stays light

        quirks.check_quirk_ids(self.disable_quirks)
        if self.init_group:
            group.pg_timeout()  # a bad LEVERS9_PG_TIMEOUT is refused here, not in every rank
        return restart_policy(self.max_restarts, self.restart_on, self.restart_delay)

    def spawn_only(self) -> dict[str, Any]:
        """The keywords that mean something only for ranks this call starts itself."""
        names = ("stall_timeout", "start_method", "prefix_output", "max_restarts", "restart_on", "restart_delay")
        return {name: getattr(self, name) for name in names}

    @property
    def prefix(self) -> bool:
        return self.prefix_output is None or bool(self.prefix_output)


def run_with(fn: Callable[..., Any], cfg: Any, options: RunOptions) -> Any:
    """`run(fn, cfg, ...)` with its keywords given as one value: the path (under a launcher, in place,
    spawned, across nodes) is chosen here, and each is one function."""
    if not callable(fn):
        raise ConfigError(f"distributed.run needs a function to call on every rank; got {type(fn).__name__} {fn!r}.")
    policy = options.check()
    slurm_env.check_started_by_srun(os.environ)  # a job script's own process, where srun was meant
    call = fn if cfg is None and _takes_no_arguments(fn) else functools.partial(fn, cfg)
    info = world.launch_info()
    if info.launcher != "single" or world.live_group() is not None:
        return _run_under_launcher(call, info, options)
    layout = plan_layout(options.nprocs, options.backend)
    job = current_job()
    if options.max_restarts is None and job is not None:
        policy = dataclasses.replace(policy, max_retries=job.max_restarts)  # @job(max_restarts=...)
    if layout.nprocs == 1 and not policy.max_retries and (job is None or job.gang is None):  # a restartable world of one runs as a started rank
        return _run_in_place(call, layout, options)
    if options.stall_timeout is None and job is not None:
        options = dataclasses.replace(options, stall_timeout=job.stall_timeout)  # @job(stall_timeout=...)
    if job is not None and job.gang is not None:  # a job holding cards on several Ray nodes (issue 25)
        return _run_across_nodes(fn, cfg, call, layout, options, policy, job)
    return _run_spawned(fn, cfg, call, layout, options, policy)


def _run_under_launcher(call: Callable[[], Any], info: detect.LaunchInfo, options: RunOptions) -> Any:
    """fn in this rank of a launcher's world (or of a group the user made), quirks applied, in the group
    (joined now unless `init_group` is False); rank 0's value, on every rank."""
    if options.nprocs is not None and options.nprocs != info.world_size:
        raise ConfigError(
            f"nprocs={options.nprocs} but this process is already one of {info.world_size} rank(s) under {info.launcher}; "
            f"the launcher decides how many ranks run. Drop nprocs=, or launch {options.nprocs} ranks "
            f"(e.g. --nproc-per-node {options.nprocs})."
        )
    _refuse_spawn_only(f"under {info.launcher}", **options.spawn_only())
    backend = options.backend or group.default_backend()
    group.apply_quirks_here(info.local_world_size, backend, options.disable_quirks)
    with SelfTimer(options.timeout, f"rank {world.rank()} of distributed.run", under_launcher=True):
        with group.joined(backend) if options.init_group else contextlib.nullcontext():
            result = call()
            if world.live_group() is not None:
                return _from_rank0(result)
        return _from_rank0_without_group(result, backend)


def _run_in_place(call: Callable[[], Any], layout: Layout, options: RunOptions) -> Any:
    """fn in this process as a world of one, quirks applied; its value."""
    _refuse_spawn_only("in place", stall_timeout=options.stall_timeout, start_method=options.start_method)
    group.apply_quirks_here(1, layout.backend, options.disable_quirks)
    with SelfTimer(options.timeout, "distributed.run (in place, a world of one)", under_launcher=False):
        return call()


def _start_method(options: RunOptions, backend: str) -> start.StartMethod:
    """How the ranks start: start_method= (or fork where safe), but fresh interpreters where stall_timeout= needs
    a flight recorder that forked ranks could not have."""
    method = start.choose(options.start_method)
    if options.stall_timeout is None or not method.forks or not flight_recorder.forked_ranks_cannot_record(backend):
        return method
    if options.start_method == "fork":
        raise ConfigError(
            "stall_timeout= with start_method='fork' on torch before 2.11: forked ranks inherit this process's "
            "flight recorder, which has no buffer for gloo unless TORCH_FR_BUFFER_SIZE was set before its first "
            "process group, and would see no collective. Expected ranks that can record; drop start_method= "
            "(fresh interpreters are then used), or export TORCH_FR_BUFFER_SIZE=2000 before Python starts."
        )
    return start.StartMethod("spawn", "on torch < 2.11 forked ranks could inherit a flight recorder without a "
                             "buffer (TORCH_FR_BUFFER_SIZE unset), and stall_timeout= needs one that records")  # fmt: skip


def _ranks_env_with_diagnostics(layout: Layout, options: RunOptions) -> dict[str, str]:
    """Every rank's variables: the quirks' defaults, and a recording flight recorder when timeout= or stall_timeout=
    asks for reports (they read it)."""
    diagnostics = options.timeout is not None or options.stall_timeout is not None
    return {**_ranks_env(layout, options.disable_quirks), **(flight_recorder.env_for_ranks() if diagnostics else {})}


def _run_spawned(fn: Callable[..., Any], cfg: Any, call: Callable[..., Any], layout: Layout, options: RunOptions,
                 policy: RetryPolicy) -> Any:  # fmt: skip
    """One process per rank, started here (again after each failure the policy restarts); rank 0's value."""
    method = _start_method(options, layout.backend)
    env = _ranks_env_with_diagnostics(layout, options)
    ranks = SpawnedRanks(call, None if method.forks else _shipped(fn, cfg, call, method), layout, env, method,
                         options.timeout, options.stall_timeout, options.prefix, options.stop_grace,
                         make_group=options.init_group)  # fmt: skip
    return _start_attempts(ranks, policy)


def _run_across_nodes(fn: Callable[..., Any], cfg: Any, call: Callable[..., Any], layout: Layout, options: RunOptions,
                      policy: RetryPolicy, job: JobContext) -> Any:  # fmt: skip
    """distributed.run inside a job that holds cards on several Ray nodes: see levers9.distributed.nodes."""
    from levers9.distributed import nodes

    gang = job.gang
    assert gang is not None
    nodes.refuse_across_nodes(options.nprocs, gang)
    if options.stall_timeout is not None:
        flight_recorder.require(layout.backend)
    method = _start_method(options, layout.backend)
    env = {k: v for k, v in _ranks_env_with_diagnostics(layout, options).items() if k not in nodes.SOCKET_VARS}
    run = nodes.GangRun(call, _shipped(fn, cfg, call, method), layout.backend, env, method, options.timeout,
                        options.stall_timeout, options.stop_grace, options.init_group, options.prefix)  # fmt: skip
    return nodes.run_across_nodes(run, policy, gang)


def _start_attempts(ranks: SpawnedRanks, policy: RetryPolicy) -> Any:
    """Start the ranks (again after each failure the policy restarts) and return rank 0's value."""
    if ranks.stall_timeout is not None:
        flight_recorder.require(ranks.layout.backend)
    with exit_on_terminate():  # SIGTERM to this process stops the ranks with stop_grace, as Ctrl-C does
        return restarts.run_attempts(policy, lambda attempt_env: _Spawn(ranks, attempt_env).run(), ranks=ranks.layout.nprocs,
                                     timeout=ranks.timeout, stall_timeout=ranks.stall_timeout)  # fmt: skip


def spawn_ranks(call: Callable[[int], Any], nprocs: int, start_method: str | None, prefix_output: bool = False) -> Any:
    """`call(rank)` in `nprocs` ranks with torch.multiprocessing.spawn's meaning: the caller's environment (no
    launcher variables, no store, no group) and no restarts; rank 0's value, or the root failure raised."""
    layout = plan_layout(nprocs, None)
    method = start.choose(start_method)
    shipped = None if method.forks else _shipped(call, None, call, method)
    ranks = SpawnedRanks(call, shipped, layout, _ranks_env(layout, (), as_torchrun=False), method, None, None, prefix_output, STOP_GRACE_S,
                         make_group=False, torchrun_env=False, pass_rank=True)  # fmt: skip
    return _start_attempts(ranks, RetryPolicy())


def _check_seconds(name: str, value: Any, *, allow_zero: bool = False) -> None:
    if value is None and name != "stop_grace":
        return
    if not is_seconds(value, zero_ok=allow_zero):
        expected = "a finite number of seconds >= 0" if allow_zero else "a finite positive number of seconds, or None for no limit"
        raise ConfigError(f"{name}={value!r}; expected {expected}. Pass e.g. {name}=30.")


def _refuse_spawn_only(where: str, **given: Any) -> None:
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

    from levers9.distributed.helpers import device

    box = [to_cpu(result) if td.get_rank() == 0 else None]
    td.broadcast_object_list(box, src=0, device=device() if td.get_backend() == "nccl" else None)
    return box[0]


def _from_rank0_without_group(result: Any, backend: str) -> Any:
    """Rank 0's `result` on every rank after fn destroyed its own group: through a group made for it alone."""
    if world.launch_info().world_size == 1:
        return result
    if not group.join_launcher_group(world.launch_info(), backend):
        return _from_rank0(result)
    try:
        return _from_rank0(result)
    finally:
        group.destroy_own_group()


def _shipped(fn: Callable[..., Any], cfg: Any, call: Callable[..., Any], method: start.StartMethod) -> bytes:
    """fn bound to cfg, pickled by value where needed (cloudpickle), or a clear error naming what cannot be."""
    for what, value in (("fn", fn), ("cfg", cfg)):
        try:
            ship(value)
        except Exception as exc:
            raise NotShippableError(
                f"{what} must be pickled to reach ranks started as fresh interpreters ({method.reason}, so they are "
                f"not forked), but {unpicklable_part(value, what)} cannot be: {type(exc).__name__}: {exc}. Expected "
                f"plain data and importable or notebook-defined functions; pass paths or settings instead of open "
                f"files, locks or live objects, and open them inside fn."
            ) from exc
    return ship(call)


def one_thread_each(nprocs: int) -> bool:
    """True when each of `nprocs` ranks gets OMP_NUM_THREADS=1, as torchrun gives it: several ranks, and the
    user set no number (ranks sharing the cores must not each start a thread per core)."""
    return nprocs > 1 and "OMP_NUM_THREADS" not in os.environ


def _ranks_env(layout: Layout, disabled: tuple[str, ...], *, as_torchrun: bool = True) -> dict[str, str]:
    """Variables every rank gets on top of the caller's environment: quirk defaults, and torchrun's thread count
    unless `as_torchrun` is False (mp.spawn's meaning: the caller's environment)."""
    from levers9.distributed.hardware import quirks

    env: dict[str, str] = {"OMP_NUM_THREADS": "1"} if as_torchrun and one_thread_each(layout.nprocs) else {}
    if quirks.applied_plan() is None:  # planned once: a job process applied its cards' plan already
        plan = quirks.plan_quirks(local_world_size=layout.nprocs, backend=layout.backend, disabled=disabled)
        plan.raise_errors()  # before any rank starts
        plan.log()
        env.update(plan.set_env)
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if name not in os.environ:
            env[name] = "lo"  # one machine: rank-to-rank sockets stay on loopback
    return env


@dataclasses.dataclass(frozen=True)
class SpawnedRanks:
    """What every attempt of a spawned run starts and how it is watched, decided once per run."""

    call: Callable[..., Any]  # fn bound to cfg (spawn: taking the rank)
    shipped: bytes | None  # `call` pickled, for ranks that are fresh interpreters
    layout: Layout
    env: dict[str, str]  # on top of the caller's, in every rank
    method: start.StartMethod
    timeout: float | None
    stall_timeout: float | None
    prefix_output: bool
    stop_grace: float
    make_group: bool = True  # every rank joins the group before fn
    torchrun_env: bool = True  # ranks get torchrun's worker variables and the parent's store (spawn: neither)
    pass_rank: bool = False  # fn(rank), as mp.spawn calls it

    @property
    def diagnostics(self) -> bool:
        """Ranks get a board folder, stack dumps on SIGUSR1 and a recorder sampler: timeout= or stall_timeout= asked."""
        return self.timeout is not None or self.stall_timeout is not None


class _Spawn:
    """One attempt of a spawned run: start the ranks, supervise them, return rank 0's value or raise the root failure."""

    def __init__(self, ranks: SpawnedRanks, attempt_env: dict[str, str]) -> None:
        self.ranks = ranks
        self.attempt_env = attempt_env  # TORCHELASTIC_RESTART_COUNT / _MAX_RESTARTS of this attempt
        # pieces of long lines, never one held whole; on a terminal, what each read brings, and the bytes as written
        self.rank_set = RankSet(RankOutput(ranks.prefix_output), terminal=True)
        self.children = self.rank_set.children
        self.where = ""  # where each rank was, asked just before a timeout or stall stopped them

    def run(self) -> Any:
        ranks, nprocs = self.ranks, self.ranks.layout.nprocs
        with contextlib.ExitStack() as cleanup:  # unwound last to first: ranks stopped, store, pipes, folder
            folder = stalls.BoardFolder(nprocs) if ranks.diagnostics else None
            if folder is not None:
                cleanup.callback(folder.remove)
            cleanup.callback(self.rank_set.close)
            port = cleanup.enter_context(hosted_store()) if ranks.torchrun_env else None
            cleanup.callback(self.rank_set.stop, ranks.stop_grace)

            def env_of(rank: int) -> dict[str, str]:
                return {**ranks.env, **({} if port is None else {**rank_vars(rank, nprocs, port), **self.attempt_env})}

            self.rank_set.start(Share(0, nprocs, nprocs, ranks.layout.backend, ranks.call if ranks.shipped is None
                                      else ranks.shipped, ranks.method, env_of, None if folder is None else str(folder.path),
                                      current_job(), make_group=ranks.make_group, pass_rank=ranks.pass_rank,
                                      stdin_rank0=ranks.torchrun_env))  # fmt: skip
            if folder is not None:
                folder.write_pids(os.getpid(), [p.pid for p in self.children])
            supervisor = self.rank_set.supervisor(
                timeout=ranks.timeout, grace=ranks.stop_grace,
                stalled=None if ranks.stall_timeout is None or folder is None
                else functools.partial(stalls.stalled_now, folder, ranks.stall_timeout),
                before_stop=functools.partial(self._ask_where, folder),
            )  # fmt: skip
            outcomes = supervisor.run()
            return self._result(supervisor.stopped_for, outcomes)

    def _ask_where(self, folder: stalls.BoardFolder | None, reason: StopReason) -> None:
        """Before a timeout or stall stops the ranks: where each live one is (stacks, collectives)."""
        if reason in (StopReason.TIMEOUT, StopReason.STALL) and folder is not None:
            self.where = stalls.where_ranks_are(folder, {i: p.pid for i, p in enumerate(self.children) if not p.poll()})

    def _result(self, stopped_for: StopReason | None, outcomes: list[Outcome]) -> Any:
        """Rank 0's value when every rank returned; else the timeout, the stall or the root failure, raised."""
        if stopped_for is StopReason.TIMEOUT:
            self._raise_stopped(RunTimeout, self._timeout_text(outcomes))
        if stopped_for is StopReason.STALL:
            assert self.ranks.stall_timeout is not None
            self._raise_stopped(StallError, stalls.stall_text(self.ranks.stall_timeout))
        if any(not o.succeeded for o in outcomes):
            self._raise_root_failure(outcomes)
        value = outcomes[0].value
        return unship_value(value, "distributed.run: rank 0's return value")

    def _raise_root_failure(self, outcomes: list[Outcome]) -> NoReturn:
        """Raise the root cause (rank, how it ended, its traceback), naming every other rank that failed by
        itself, with its own report below, and the ranks that were stopped, as torchrun's summary does."""
        root = root_cause(outcomes)
        index = outcomes.index(root)
        also = [i for i, o in enumerate(outcomes) if i != index and not o.succeeded and o.stopped_for is None]
        stopped = [str(i) for i, o in enumerate(outcomes) if o.stopped_for is not None]
        others = "".join(f"; rank {i} also failed (below)" for i in also)
        others += f"; rank(s) {', '.join(stopped)} were stopped" if stopped else ""
        raise_root(rank_failure(index, root, self.children[index].tail), root, world=len(outcomes), others=others,
                   also=[rank_failure(i, outcomes[i], self.children[i].tail) for i in also])  # fmt: skip

    def _raise_stopped(self, error: type[RankFailed], headline: str) -> NoReturn:
        """Raise `error` with the report of where every rank was and their last output."""
        tails = "".join(f"\n\nLast output of {p.name}:\n" + "\n".join(list(p.tail)[-10:]) for p in self.children if p.tail)
        raise error(f"{headline}\n{self.where}{tails}")

    def _timeout_text(self, outcomes: list[Outcome]) -> str:
        running = ", ".join(str(i) for i, o in enumerate(outcomes) if o.stopped_for is not None)
        timeout = self.ranks.timeout
        waiting = "".join(
            f" Rank {i} had returned and was waiting for its non-daemon thread(s) {', '.join(map(repr, child.waiting_for))} "
            f"to end, as an interpreter does at exit (make a thread daemon=True, or join it within the run)."
            for i, child in enumerate(self.children) if child.waiting_for and outcomes[i].stopped_for is not None
        )
        return (
            f"distributed.run timed out: still running after {timeout:g} s (timeout={timeout:g}); rank(s) {running} "
            f"had not finished and every rank was stopped.{waiting} Expected the run to finish within the timeout; "
            f"pass a larger timeout=, or None for no limit. Where each rank was:"
        )
