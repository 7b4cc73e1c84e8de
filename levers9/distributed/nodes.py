"""`distributed.run` across several nodes: node 0 starts its share of ranks, each node's agent starts its own.

A job that holds cards on several Ray nodes (levers9/launch/ray/gang.py) runs its function on node 0
with a GangContext. There, `run_across_nodes` hosts the ranks' rendezvous store on node 0's address
(a port it bound itself, fresh for every attempt), starts global ranks 0..share-1, and posts one
start request into the job's control store; the agent on node i (node_agent.serve, in its Ray task) starts
global ranks first_rank(i).. with torchrun's full variable set, supervises them with levers9.procs
and posts the first failure of its node. Node 0 treats those reports as it treats its own ranks'
(root cause first in time, peer-loss errors last), and declares a node lost when its agent's
heartbeat counter stopped moving for LOST_AFTER_S. Nothing here imports Ray.

The keys of the job's control store, and the values that cross it, are levers9/distributed/control_store.py.

A restart after a node was lost first waits for a replacement: node 0's Ray task (levers9/launch/ray/gang.py)
starts a new agent in the lost node's placement-group bundle once Ray has placed that bundle on an alive
node, and node 0 waits for it to join for at most the job's queue_timeout (REPLACE_WAIT_S when that is None).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import logging
import os
import socket
import struct
import time
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

from levers9.distributed import detect, restarts, stalls
from levers9.distributed.control_store import ControlStore, Report, StartRequest, hosted_store
from levers9.distributed.rank_set import RankOutput, RankSet, Share, rank_vars
from levers9.distributed.restarts import raise_root, rank0_value, rank_failure
from levers9.errors import ConfigError, FailureKind, NodeLost, RankFailure, RunTimeout, StallError
from levers9.procs import lines, start
from levers9.procs.failure import FailureRecord
from levers9.procs.outcome import Outcome, StopReason, root_cause, this_clock, wall_clock
from levers9.procs.supervise import ROOT_CAUSE_WINDOW_S, Supervisor
from levers9.procs.watch import Child, Ended, exit_on_terminate
from levers9.retries import RetryPolicy
from levers9.runtime import GangContext, JobContext, current_job

log = logging.getLogger("levers9.distributed")
T = TypeVar("T")

HEARTBEAT_EVERY_S = 0.5  # an agent bumps its counter this often
LOST_AFTER_S = 5.0  # a counter that did not move for this long: the node is lost
POLL_EVERY_S = 0.1  # node 0 reads the control store this often
# node 0 waits longer: an agent's report of an earlier failure is on its way (its window, then node 0's poll)
ACROSS_NODES_WINDOW_S = ROOT_CAUSE_WINDOW_S + 2 * POLL_EVERY_S + 0.15
ANSWER_WAIT_S = 10.0  # how long node 0 waits for the other nodes' fresh samples and stack reports
SOCKET_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
SEND_BYTES = lines.PIECE_BYTES  # an agent sends its ranks' output at once when this much waits
AHEAD = 4  # batches an agent sends before node 0 took the first of them


def control_client(gang: GangContext, timeout: float = 30.0) -> ControlStore:
    """A client of the job's control store, under the job's secret."""
    import torch.distributed as td

    client = td.TCPStore(gang.control_addr, gang.control_port, None, False, datetime.timedelta(seconds=timeout))
    return ControlStore.under_secret(client, gang.secret)


def interface_of(address: str) -> str | None:
    """The name of the network interface that carries `address` (lo for 127.0.0.x), None if none does."""
    if address.startswith("127."):
        return "lo"
    for _, name in socket.if_nameindex():
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    return None


def socket_env(address: str, user_env: dict[str, str]) -> dict[str, str]:
    """GLOO_/NCCL_SOCKET_IFNAME = the interface carrying this node's Ray address, unless the user set them."""
    iface = interface_of(address)
    if iface is None:
        return {}
    return {name: iface for name in SOCKET_VARS if name not in user_env}


def rank_failure_of(report: Report) -> RankFailure:
    """The caller's RankFailure for a node's report of a failed rank."""
    outcome = Outcome(report.pid, report.exitcode, report.signal, failure=report.failure, reported=True)
    return rank_failure(report.rank, outcome, report.tail)


def report_of(child: Child, rank: int, node: int, address: str) -> Report:
    """A Report for a failed child, timed by its own failure record (or, for a crash, when it was seen ending)."""
    seen = child.failure.when if child.failure is not None else child.ended_at
    when = time.time() if seen is None else wall_clock(seen)
    return Report(rank, node, address, child.pid, child.exitcode, child.signal, child.failure, tuple(child.tail), when)


def where_on_node(board: stalls.BoardFolder, ranks: list[Child], first: int, node: int, address: str) -> str:
    """Where each live rank of this node is (collective, stack), each named by its global rank and its node."""
    live = {i: p.pid for i, p in enumerate(ranks) if p.status is None}
    return stalls.where_ranks_are(board, live, [f"rank {first + i} on node {node} ({address})" for i in range(len(ranks))])


# ---- node 0: the job process -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GangRun:
    """What every attempt of a multi-node run starts: fn shipped, the rank variables common to every node."""

    call: Callable[..., Any]
    shipped: bytes  # fn bound to cfg, pickled by value: other nodes always get it this way
    backend: str
    env: dict[str, str]  # quirk defaults etc. from node 0's plan, for every rank (socket names excluded)
    method: start.StartMethod
    timeout: float | None
    stall_timeout: float | None
    stop_grace: float
    make_group: bool
    prefix_output: bool

    @property
    def diagnostics(self) -> bool:
        """Each node's ranks get a board folder (stall detection, where they are when stopped)."""
        return self.timeout is not None or self.stall_timeout is not None


def run_across_nodes(run: GangRun, policy: RetryPolicy, gang: GangContext) -> Any:
    """Rank 0's value of fn run on every rank of every node the job holds; the root failure raised otherwise."""
    job = current_job()
    assert job is not None
    runner = _NodeZero(run, gang, job)
    with exit_on_terminate(), contextlib.ExitStack() as cleanup:
        runner.store = control_client(gang)
        cleanup.callback(runner.forget_store)
        runner.wait_for_agents()
        return restarts.run_attempts(policy, runner.attempt, ranks=gang.world_size, timeout=run.timeout, stall_timeout=None)


def refuse_across_nodes(nprocs: int | None, gang: GangContext) -> None:
    """What a multi-node run does not take: ConfigError before anything starts."""
    if nprocs is not None and nprocs != gang.world_size:
        raise ConfigError(
            f"nprocs={nprocs} but this job holds {gang.describe()} card(s), one rank per card. Expected nprocs unset "
            f"(or {gang.world_size}); ask @job(gpu_count=...) for the number of ranks you want."
        )


class _NodeZero:
    """Node 0's side: joins the agents, starts attempts, watches every node, raises the root failure."""

    def __init__(self, run: GangRun, gang: GangContext, job: JobContext) -> None:
        self.run, self.gang, self.job = run, gang, job
        self.store: ControlStore | None = None
        self.lost: dict[int, str] = {}  # node -> why, once declared lost

    def forget_store(self) -> None:
        self.store = None

    @property
    def control(self) -> ControlStore:
        assert self.store is not None, "used outside run_across_nodes"
        return self.store

    @property
    def agents(self) -> range:
        return range(1, len(self.gang.shares))

    def _ranks_of(self, node: int) -> tuple[int, ...]:
        first = self.gang.first_rank(node)
        return tuple(range(first, first + self.gang.shares[node]))

    def _name(self, node: int) -> str:
        return f"node {node} ({self.gang.addresses[node]}, ranks {_span(self._ranks_of(node))})"

    def wait_for_agents(self) -> None:
        """Return once every agent has joined (the gang then names each node by the address it joined from);
        NodeLost naming the ones that never did after the gang's join_within seconds."""
        deadline = time.monotonic() + self.gang.join_within
        while True:
            missing = [i for i in self.agents if self.control.joined(i) is None]
            if not missing:
                break
            if time.monotonic() >= deadline:
                names = "; ".join(self._name(i) for i in missing)
                raise NodeLost(
                    f"distributed.run across {self.gang.describe()}: the levers9 agent of {names} never joined within "
                    f"{self.gang.join_within:g} s. Expected every node's agent to start; {self.gang.check_node}.",
                    self.gang.addresses[missing[0]], self._ranks_of(missing[0]),
                )
            time.sleep(POLL_EVERY_S)
        for i in self.agents:
            address = self.control.joined(i)
            if address is not None and address != self.gang.addresses[i]:
                self._moved(i, address)

    def attempt(self, attempt_env: dict[str, str]) -> Any:
        n = self.control.next_attempt()  # counted in the store: a job may call distributed.run again
        for i in self.agents:
            if i not in self.lost and self.control.is_lost(i):
                self.lost[i] = "an earlier distributed.run of this job lost it"
        if self.lost:
            self._replace_lost(n)
        return _Attempt(self, n, attempt_env).run_it()

    def _replace_lost(self, n: int) -> None:
        """Before attempt n: a new agent for every lost node, placed by Ray on an alive node; NodeLost naming the
        lost node when none joined within the wait (the job's queue_timeout)."""
        within = self.gang.replace_within
        waiting = sorted(self.lost)
        for i in waiting:
            self.control.ask_replacement(i, n)
        log.warning("distributed.run across %s: waiting up to %g s for a node to replace %s",
                    self.gang.describe(), within, "; ".join(self._name(i) for i in waiting))  # fmt: skip
        deadline = time.monotonic() + within + ANSWER_WAIT_S  # node 0's Ray task posts noreplace/<i> at `within`
        while waiting:
            for i in list(waiting):
                address = self.control.joined(i)
                if address is not None:
                    old = self._name(i)
                    self._moved(i, address)
                    self.control.replaced(i)
                    del self.lost[i]
                    waiting.remove(i)
                    log.warning("distributed.run: %s is replaced by %s", old, self._name(i))
                    continue
                why = self.control.replacement_refused(i)
                if why is not None or time.monotonic() >= deadline:
                    raise self._lost_error(i, f"{self.lost[i]}; no node replaced it within {within:g} s (the job's "
                                              f"queue_timeout){': ' + why if why else ''}", FailureKind.QUEUE)  # fmt: skip
            time.sleep(POLL_EVERY_S)

    def _moved(self, node: int, address: str) -> None:
        """Node `node`'s agent now runs on `address`: the gang (and the job context the ranks get) say so."""
        addresses = tuple(address if i == node else a for i, a in enumerate(self.gang.addresses))
        self.gang = dataclasses.replace(self.gang, addresses=addresses)
        self.job = dataclasses.replace(self.job, gang=self.gang)

    def _lost_error(self, node: int, why: str, kind: FailureKind = FailureKind.LOST) -> NodeLost:
        return NodeLost(
            f"distributed.run across {self.gang.describe()}: lost {self._name(node)}: {why}. Every rank on the other "
            f"node(s) was stopped. Expected every node to answer levers9's heartbeat (every {HEARTBEAT_EVERY_S:g} s); "
            f"{self.gang.check_node}, and its kernel log for the OOM killer; then run again.",
            self.gang.addresses[node], self._ranks_of(node), kind,
        )


def _span(ranks: tuple[int, ...]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])


class NodeShare(Ended):
    """Another node's share of an attempt, as node 0's Supervisor watches it beside node 0's own ranks: it ends when
    the node's agent posts that its ranks all returned, or their first failure (a Report: the failed rank's fields,
    its time made this machine's), and it is lost once the agent's heartbeat counter did not move for
    LOST_AFTER_S. Each poll prints the output the node sent (in pieces, through node 0's RankOutput)."""

    result: bytes | None = None  # what a share's rank 0 returned stays on its node
    oom_before: int | None = None

    def __init__(self, attempt: _Attempt, node: int) -> None:
        self.attempt, self.node = attempt, node
        self.rank = attempt.gang.first_rank(node)  # the failed rank, once one is reported
        self.pid = 0
        self.status: tuple[int | None, int | None] | None = None
        self.failure: FailureRecord | None = None
        self.reported = False
        self.lost = False
        self.ended_at: float | None = None
        self.tail: tuple[str, ...] = ()
        self.quiet: stalls.Quiet | None = None  # its ranks' last Quiet (stall_timeout=)
        self._beat = (-1, time.monotonic())  # (last counter, when it last moved)
        self._printed = 0  # the last batch of its output printed here
        self._next_poll = 0.0

    def poll(self) -> bool:
        """Read the node's news every POLL_EVERY_S; True once its share ended (or was lost)."""
        now = time.monotonic()
        if self.status is not None or now < self._next_poll:
            return self.status is not None
        self._next_poll = now + POLL_EVERY_S
        store, n = self.attempt.store, self.attempt.n
        report = store.failure(n, self.node)
        done = report is None and store.is_done(n, self.node)
        self.print_output()  # after the flags: a node posts its output before them
        if self.attempt.zero.run.stall_timeout is not None and (quiet := store.quiet(n, self.node)) is not None:
            self.quiet = quiet
        count = store.beats(self.node)
        if count != self._beat[0]:
            self._beat = (count, now)
        if report is not None:
            self._failed(report)
        elif done:
            self.status, self.ended_at = (0, None), now
        elif now - self._beat[1] >= LOST_AFTER_S:
            self._lose()
        return self.status is not None

    def _failed(self, report: Report) -> None:
        here = this_clock(report.wall)
        self.rank, self.pid, self.tail, self.reported = report.rank, report.pid, report.tail, True
        self.failure = None if report.failure is None else dataclasses.replace(report.failure, when=here)
        self.status, self.ended_at = (report.exitcode, report.signal), here

    def _lose(self) -> None:
        """Heartbeat silence: lost since the counter last moved; node 0's task cancels its agent at once."""
        why = f"its agent's heartbeat stopped for {LOST_AFTER_S:g} s"
        self.attempt.zero.lost[self.node] = why
        with contextlib.suppress(Exception):
            self.attempt.store.declare_lost(self.node)
        self.lost, self.status, self.ended_at = True, (None, None), self._beat[1]

    def print_output(self) -> None:
        """Print the batches of the node's rank output that arrived since the last poll, in order."""
        for seq, batch in self.attempt.store.take_output(self.attempt.n, self.node, self._printed):
            for rank, stream, text in batch:
                self.attempt.output(rank, stream, text)
            self._printed = seq


class _Attempt:
    """One attempt on every node: node 0's ranks and every other node's share under one Supervisor, then rank 0's
    value, or the root failure, the lost node, the timeout or the stall raised."""

    def __init__(self, zero: _NodeZero, number: int, attempt_env: dict[str, str]) -> None:
        self.zero, self.n, self.attempt_env = zero, number, attempt_env
        self.store = zero.control
        self.gang = zero.gang
        self.output = RankOutput(zero.run.prefix_output)
        self.ranks = RankSet(self.output, terminal=True)
        self.shares = [NodeShare(self, i) for i in zero.agents]
        self.board: stalls.BoardFolder | None = None  # node 0's ranks' board (timeout= or stall_timeout= asked)
        self.supervisor: Supervisor | None = None
        self.rounds = 0  # stall confirmations asked of every node
        self.where = ""  # where every rank was, asked just before a timeout or stall stopped them

    def run_it(self) -> Any:
        run, gang = self.zero.run, self.gang
        address = gang.addresses[0]
        with contextlib.ExitStack() as cleanup:  # unwound last to first: ranks stopped, store, pipes, board
            if run.diagnostics:
                self.board = stalls.BoardFolder(gang.shares[0])
                cleanup.callback(self.board.remove)
            cleanup.callback(self.ranks.close)
            port = cleanup.enter_context(hosted_store(address))  # the ranks' rendezvous store of this attempt
            cleanup.callback(self.ranks.stop, run.stop_grace)
            run_id = f"{detect.LEVERS9_RUN_ID_PREFIX}{os.getpid()}-{port}"
            sockets = socket_env(address, dict(os.environ))

            def env_of(rank: int) -> dict[str, str]:
                return {**run.env, **sockets, **rank_vars(rank, gang.world_size, port, addr=address, run_id=run_id,
                                                          shares=gang.shares, secret=gang.secret), **self.attempt_env}  # fmt: skip

            self.ranks.start(Share(0, gang.shares[0], gang.world_size, run.backend, run.call if run.method.forks
                                   else run.shipped, run.method, env_of, None if self.board is None else
                                   str(self.board.path), self.zero.job, make_group=run.make_group))  # fmt: skip
            if self.board is not None:
                self.board.write_pids(os.getpid(), [p.pid for p in self.ranks.children])
            request = StartRequest(call=run.shipped, backend=run.backend, env=run.env, master=(address, port),
                                   run_id=run_id, attempt_env=self.attempt_env, make_group=run.make_group,
                                   stop_grace=run.stop_grace, prefix_output=run.prefix_output, forks=run.method.forks,
                                   diagnostics=run.diagnostics, stall_timeout=run.stall_timeout)  # fmt: skip
            self.store.post_start(self.n, request)
            self.supervisor = self.ranks.supervisor(
                *self.shares, timeout=run.timeout, grace=run.stop_grace, before_stop=self._before_stop,
                stalled=None if run.stall_timeout is None else self._stalled,
                window=ACROSS_NODES_WINDOW_S, peer_loss_window=LOST_AFTER_S + 1,  # a peer's loss may wait for its heartbeat
            )  # fmt: skip
            try:
                outcomes = self.supervisor.run()
            except BaseException:
                self._stop_everywhere()
                raise
            if self.supervisor.stopped_for is not None or not all(o.succeeded for o in outcomes):
                self._stop_everywhere()
            return self._result(self.supervisor.stopped_for, outcomes)

    def _before_stop(self, reason: StopReason) -> None:
        """Before the supervisor stops node 0's ranks: where every rank is (a timeout or a stall), and every other
        node asked to stop its ranks too."""
        if reason in (StopReason.TIMEOUT, StopReason.STALL):
            self.where = self._where()
        with contextlib.suppress(Exception):
            self.store.ask_stop(self.n)

    def _result(self, stopped_for: StopReason | None, outcomes: list[Outcome]) -> Any:
        timeout, stall_timeout = self.zero.run.timeout, self.zero.run.stall_timeout
        if stopped_for is StopReason.TIMEOUT:
            assert timeout is not None
            raise RunTimeout(
                f"distributed.run timed out: still running after {timeout:g} s (timeout={timeout:g}) across "
                f"{self.gang.describe()}; every rank on every node was stopped. Expected the run to finish "
                f"within the timeout; pass a larger timeout=, or None for no limit. Where each rank was:\n{self.where}"
            )
        if stopped_for is StopReason.STALL:
            assert stall_timeout is not None
            raise StallError(f"{stalls.stall_text(stall_timeout)}\nWhere each rank was, on every node:\n{self.where}")
        return rank0_value(outcomes, self._raise_root)

    def _raise_root(self, outcomes: list[Outcome]) -> NoReturn:
        """Raise the root cause by outcome.root_cause's rule, named by its rank and its node (or the lost node)."""
        root = root_cause(outcomes)
        index = outcomes.index(root)
        local = len(self.ranks.children)
        if index < local:
            node, rank, tail = 0, index, tuple(self.ranks.children[index].tail)
        else:
            share = self.shares[index - local]
            node, rank, tail = share.node, share.rank, share.tail
        if root.lost:
            raise self.zero._lost_error(node, self.zero.lost[node])
        stopped = f"; every other rank of {self.gang.world_size} on {len(self.gang.shares)} nodes was stopped"
        raise_root(rank_failure(rank, root, tail), root, world=self.gang.world_size, others=stopped,
                   where=f" on node {node} ({self.gang.addresses[node]})")  # fmt: skip

    def _stalled(self, now: float) -> bool:
        """True once every node's ranks were quiet for stall_timeout s while one waited, confirmed on fresh samples
        from every node (a node that does not answer is left to the heartbeat)."""
        stall_timeout = self.zero.run.stall_timeout
        quiets = [s.quiet for s in self.shares if s.quiet is not None]
        if stall_timeout is None or self.board is None or len(quiets) < len(self.shares):
            return False
        if not stalls.stall_of([stalls.quiet_now(self.board, now), *quiets], stall_timeout):
            return False
        self.rounds += 1
        self.store.ask_confirm(self.n, self.rounds)
        mine = stalls.quiet_confirmed(self.board)
        theirs = self._answers(lambda i: self.store.confirmed(self.n, i, self.rounds))
        if len(theirs) < len(self.shares):
            return False
        return stalls.stall_of([mine, *theirs.values()], stall_timeout)

    def _where(self) -> str:
        """Before a stall or timeout stops them: where every live rank on every node is (asked of all at once)."""
        if self.board is None:
            return "  (no report: the ranks were started without a board folder)"
        with contextlib.suppress(Exception):
            self.store.ask_where(self.n)
        texts = [where_on_node(self.board, self.ranks.children, 0, 0, self.gang.addresses[0])]
        answers = self._answers(lambda i: self.store.where(self.n, i))
        for i in self.zero.agents:
            texts.append(answers[i] if i in answers else f"  {self.zero._name(i)}: did not answer")
        return "\n\n".join(texts)

    def _answers(self, read: Callable[[int], T | None]) -> dict[int, T]:
        """Each other node's answer read(node), waited for up to ANSWER_WAIT_S; the nodes that did not answer are left out."""
        answers: dict[int, T] = {}
        deadline = time.monotonic() + ANSWER_WAIT_S
        while True:
            for i in self.zero.agents:
                with contextlib.suppress(Exception):
                    if i not in answers and (answer := read(i)) is not None:
                        answers[i] = answer
            if len(answers) == len(self.zero.agents) or time.monotonic() >= deadline:
                return answers
            assert self.supervisor is not None
            self.supervisor.idle(0.05)

    def _stop_everywhere(self) -> None:
        """SIGTERM + stop_grace + SIGKILL for every rank on every node; returns once each live node says they are
        gone, with what they wrote printed."""
        grace = self.zero.run.stop_grace
        with contextlib.suppress(Exception):
            self.store.ask_stop(self.n)
        self.ranks.stop(grace)
        deadline = time.monotonic() + grace + 5.0
        waiting = [i for i in self.zero.agents if i not in self.zero.lost]
        while waiting and time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                waiting = [i for i in waiting if not self.store.is_stopped(self.n, i)]
            if waiting:
                time.sleep(0.05)
        for share in self.shares:
            if share.node not in self.zero.lost:
                with contextlib.suppress(Exception):
                    share.print_output()
