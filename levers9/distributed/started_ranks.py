"""The ranks `distributed.run` and `distributed.spawn` start on this machine, and each attempt of them.

Their variables (the quirks planned once for their world), how they start (forked where that is safe, else fresh
interpreters with fn and cfg shipped by value), each attempt as a rank set under the one supervisor, meeting on a
store this process hosts on loopback; the first failure stops the rest and is raised with the rank's own traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from levers9.distributed import restarts, stalls
from levers9.distributed.control_store import hosted_store
from levers9.distributed.devices import Layout, plan_layout
from levers9.distributed.rank_set import RankOutput, RankSet, Share, rank_vars
from levers9.distributed.restarts import raise_root, rank0_value, rank_failed_behind, rank_failure
from levers9.distributed.stalls import board
from levers9.errors import ConfigError, NotShippableError, RankFailed, RunTimeout, StallError, add_note
from levers9.procs import start
from levers9.procs.failure import process_limit_note, ship, unpicklable_part
from levers9.procs.outcome import Outcome, StopReason, root_cause
from levers9.procs.start import held_heap
from levers9.procs.watch import Child, exit_on_terminate
from levers9.retries import RetryPolicy
from levers9.runtime import current_job

if TYPE_CHECKING:
    from levers9.distributed.torchrun_agent import TorchrunAgent

STOP_GRACE_S = 5.0  # default stop_grace: SIGTERM, then SIGKILL after this long


def start_method(asked: str | None, stall_timeout: float | None, backend: str) -> start.StartMethod:
    """How the ranks start: start_method= `asked` (or fork where safe), but fresh interpreters where stall_timeout=
    needs a flight recorder that forked ranks could not have."""
    method = start.choose(asked)
    if stall_timeout is None or not method.forks or not board.forked_ranks_cannot_record(backend):
        return method
    if asked == "fork":
        raise ConfigError(
            "stall_timeout= with start_method='fork' on torch before 2.11: forked ranks inherit this process's "
            "flight recorder, which has no buffer for gloo unless TORCH_FR_BUFFER_SIZE was set before its first "
            "process group, and would see no collective. Expected ranks that can record; drop start_method= "
            "(fresh interpreters are then used), or export TORCH_FR_BUFFER_SIZE=2000 before Python starts."
        )
    return start.StartMethod("spawn", "on torch < 2.11 forked ranks could inherit a flight recorder without a "
                             "buffer (TORCH_FR_BUFFER_SIZE unset), and stall_timeout= needs one that records")  # fmt: skip


def ranks_env_with_diagnostics(layout: Layout, disabled: tuple[str, ...], diagnostics: bool) -> dict[str, str]:
    """ranks_env, and a recording flight recorder when timeout= or stall_timeout= asks for reports (`diagnostics`)."""
    return {**ranks_env(layout, disabled), **(board.env_for_ranks() if diagnostics else {})}


def start_attempts(ranks: StartedRanks, policy: RetryPolicy) -> Any:
    """Start the ranks (again after each failure the policy restarts) and return rank 0's value."""
    if ranks.stall_timeout is not None:
        board.require(ranks.layout.backend)
    with exit_on_terminate():  # SIGTERM to this process stops the ranks with stop_grace, as Ctrl-C does
        try:
            return restarts.run_attempts(policy, lambda attempt_env: _RanksAttempt(ranks, attempt_env).run(), ranks=ranks.layout.nprocs,
                                         timeout=ranks.timeout, stall_timeout=ranks.stall_timeout, caller=ranks.caller)  # fmt: skip
        except (OSError, RuntimeError) as exc:  # a rank or a thread of this process's that could not be started
            if rank_failed_behind(exc) is None and (note := process_limit_note(exc)):
                add_note(exc, note)
            raise


def start_like_mp_spawn(call: Callable[[int], Any], nprocs: int, asked_method: str | None, prefix_output: bool = False) -> Any:
    """`call(rank)` in `nprocs` ranks with torch.multiprocessing.spawn's meaning: the caller's environment (no
    launcher variables, no store, no group) and no restarts; rank 0's value, or the root failure raised."""
    with held_heap():  # this process only starts and watches the ranks
        layout = plan_layout(nprocs, None)
        method = start.choose(asked_method)
        shipped = None if method.forks else shipped_call(call, None, call, method)
        ranks = StartedRanks(call, shipped, layout, ranks_env(layout, (), as_torchrun=False), method, None, None, prefix_output,
                             STOP_GRACE_S, make_group=False, torchrun_env=False, pass_rank=True, caller="spawn")  # fmt: skip
        return start_attempts(ranks, RetryPolicy())


def shipped_call(fn: Callable[..., Any], cfg: Any, call: Callable[..., Any], method: start.StartMethod) -> bytes:
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


def ranks_env(layout: Layout, disabled: tuple[str, ...], *, as_torchrun: bool = True) -> dict[str, str]:
    """Variables every rank gets on top of the caller's environment: the quirks' defaults for this world (planned
    here, errors raised before any rank starts, unless a job process applied its cards' plan already), and
    torchrun's thread count unless `as_torchrun` is False (mp.spawn's meaning: the caller's environment)."""
    from levers9.distributed.hardware import quirks  # loads on use, not with levers9.distributed

    env: dict[str, str] = {"OMP_NUM_THREADS": "1"} if as_torchrun and one_thread_each(layout.nprocs) else {}
    plan = quirks.plan_for_world(local_world_size=layout.nprocs, backend=layout.backend, disabled=disabled)
    if plan is not None:
        env.update(plan.set_env)
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if name not in os.environ:
            env[name] = "lo"  # one machine: rank-to-rank sockets stay on loopback
    return env


@dataclasses.dataclass(frozen=True)
class StartedRanks:
    """What every attempt of a run whose ranks start here starts and how it is watched, decided once per run."""

    call: Callable[..., Any]  # fn bound to cfg (mp.spawn's meaning: taking the rank)
    shipped: bytes | None  # `call` pickled, for ranks that are fresh interpreters
    layout: Layout
    env: dict[str, str]  # on top of the caller's, in every rank
    method: start.StartMethod
    timeout: float | None
    stall_timeout: float | None
    prefix_output: bool
    stop_grace: float
    make_group: bool = True  # every rank joins the group before fn
    torchrun_env: bool = True  # ranks get torchrun's worker variables and the parent's store (mp.spawn's: neither)
    pass_rank: bool = False  # fn(rank), as mp.spawn calls it
    caller: str = "distributed.run"  # who started them, in messages ("levers9 run"); "spawn" raises what mp.spawn raises
    agent: TorchrunAgent | None = None  # levers9 run's: torchrun's files, role, prefixes, port, run id (torchrun_agent.py)

    @property
    def diagnostics(self) -> bool:
        """Ranks get a board folder, stack dumps on SIGUSR1 and a recorder sampler: timeout= or stall_timeout= asked."""
        return self.timeout is not None or self.stall_timeout is not None


class _RanksAttempt:
    """One attempt of the ranks started here: start the ranks, supervise them, return rank 0's value or raise the root failure."""

    def __init__(self, ranks: StartedRanks, attempt_env: dict[str, str]) -> None:
        self.ranks = ranks
        self.attempt_env = attempt_env  # TORCHELASTIC_RESTART_COUNT / _MAX_RESTARTS of this attempt
        self.rank_set: RankSet  # made by run(), once the attempt's variables are known
        self.children: list[Child] = []
        self.where = ""  # where each rank was, asked just before a timeout or stall stopped them

    def run(self) -> Any:
        ranks, nprocs = self.ranks, self.ranks.layout.nprocs
        with contextlib.ExitStack() as cleanup:  # unwound last to first: ranks stopped, pipes, log files, store, folder
            folder = stalls.BoardFolder(nprocs) if ranks.diagnostics else None
            if folder is not None:
                cleanup.callback(folder.remove)
            agent = ranks.agent
            preferred, run_id = (None, None) if agent is None else (agent.master_port, agent.run_id)
            port = cleanup.enter_context(hosted_store(preferred_port=preferred)) if ranks.torchrun_env else None
            envs = {rank: {**ranks.env, **({} if port is None else {**rank_vars(rank, nprocs, port, run_id=run_id),
                                                                   **self.attempt_env})} for rank in range(nprocs)}  # fmt: skip
            # pieces of long lines, never one held whole; on a terminal, what each read brings, and the bytes as written
            sink: Callable[[int, str, str], None] = RankOutput(ranks.prefix_output)
            if agent is not None:  # levers9 run's: never spawn's, so the ranks have a store
                output = agent.attempt(envs, sink)  # torchrun's files for this attempt (and their variables)
                cleanup.callback(output.close)
                sink = output
            self.rank_set = RankSet(sink, terminal=True)
            self.children = self.rank_set.children
            cleanup.callback(self.rank_set.close)
            cleanup.callback(self.rank_set.stop, ranks.stop_grace)
            self.rank_set.start(Share(0, nprocs, nprocs, ranks.layout.backend, ranks.call if ranks.shipped is None
                                      else ranks.shipped, ranks.method, envs.__getitem__, None if folder is None else str(folder.path),
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
        return rank0_value(outcomes, self._raise_root_failure, self.ranks.caller)

    def _raise_root_failure(self, outcomes: list[Outcome]) -> NoReturn:
        """Raise the root cause (rank, how it ended, its traceback), naming every other rank that failed by
        itself, with its own report below, and the ranks that were stopped, as torchrun's summary does."""
        root = root_cause(outcomes)
        index = outcomes.index(root)
        also = [i for i, o in enumerate(outcomes) if i != index and not o.succeeded and o.stopped_for is None]
        stopped = [str(i) for i, o in enumerate(outcomes) if o.stopped_for is not None]
        who, several = ("process", "process(es)") if self.ranks.caller == "spawn" else ("rank", "rank(s)")  # mp.spawn's words
        others = "".join(f"; {who} {i} also failed (below)" for i in also)
        others += f"; {several} {', '.join(stopped)} were stopped" if stopped else ""
        raise_root(rank_failure(index, root, self.children[index].tail), root, world=len(outcomes), others=others,
                   also=[rank_failure(i, outcomes[i], self.children[i].tail) for i in also], caller=self.ranks.caller)  # fmt: skip

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
