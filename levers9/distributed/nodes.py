"""`distributed.run` across several nodes: node 0 starts its share of ranks, each node's agent starts its own.

A job that holds cards on several Ray nodes (levers9/launch/ray_gang.py) runs its function on node 0
with a GangContext. There, `run_across_nodes` hosts the ranks' rendezvous store on node 0's address
(a port it bound itself, fresh for every attempt), starts global ranks 0..share-1, and posts one
start request into the job's control store; the agent on node i (`serve`, in its Ray task) starts
global ranks first_rank(i).. with torchrun's full variable set, supervises them with levers9.procs
and posts the first failure of its node. Node 0 treats those reports as it treats its own ranks'
(root cause first in time, peer-loss errors last), and declares a node lost when its agent's
heartbeat counter stopped moving for LOST_AFTER_S. Nothing here imports Ray.

The keys of the job's control store, and the values that cross it, are levers9/distributed/control_store.py.

A restart after a node was lost first waits for a replacement: node 0's Ray task (levers9/launch/ray_gang.py)
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
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

from levers9.context import GangContext, JobContext, current_job
from levers9.distributed import detect, group, restarts, stalls
from levers9.distributed.control_store import ControlStore, Report, StartRequest
from levers9.distributed.rank_process import RankSpec, RankTarget
from levers9.distributed.store_server import hosted_store
from levers9.errors import (
    ConfigError,
    FailureKind,
    NodeLost,
    RankCrashed,
    RankFailure,
    RunTimeout,
    StallError,
)
from levers9.procs import echo, start
from levers9.procs.failure import raise_rank_exception, ship, unship, unship_value
from levers9.procs.outcome import Outcome, consequence, kind_of
from levers9.procs.supervise import ROOT_CAUSE_WINDOW_S
from levers9.procs.watch import Child, Watcher, exit_on_terminate, output_excerpt
from levers9.retries import RetryPolicy

log = logging.getLogger("levers9.distributed")
T = TypeVar("T")

HEARTBEAT_EVERY_S = 0.5  # an agent bumps its counter this often
LOST_AFTER_S = 5.0  # a counter that did not move for this long: the node is lost
JOIN_TIMEOUT_S = 120.0  # agents that have not joined by then are named
POLL_EVERY_S = 0.1  # node 0 reads the control store this often
# node 0 waits longer: an agent's report of an earlier failure is on its way (its window, then node 0's poll)
ACROSS_NODES_WINDOW_S = ROOT_CAUSE_WINDOW_S + 2 * POLL_EVERY_S + 0.15
ANSWER_WAIT_S = 10.0  # how long node 0 waits for the other nodes' fresh samples and stack reports
SOCKET_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


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


def node_rank_env(rank: int, local_rank: int, world: int, gang: GangContext, node: int, master: tuple[str, int],
                  run_id: str, attempt_env: dict[str, str]) -> dict[str, str]:  # fmt: skip
    """torchrun's worker variables for global `rank` (local rank `local_rank` on node `node`) of a multi-node run.

    MASTER_ADDR/MASTER_PORT name the store node 0 hosts on its Ray address; TORCHELASTIC_USE_AGENT_STORE=True
    makes torch's env:// rendezvous join it as a client, as under torchrun. No LEVERS9_STORE_PORT (that one
    means a loopback store)."""
    r, w, lw = str(rank), str(world), str(gang.shares[node])
    return {
        "RANK": r, "LOCAL_RANK": str(local_rank), "ROLE_RANK": r, "WORLD_SIZE": w, "LOCAL_WORLD_SIZE": lw,
        "ROLE_WORLD_SIZE": w, "GROUP_RANK": str(node), "NODE_RANK": str(node), "GROUP_WORLD_SIZE": str(len(gang.shares)),
        "ROLE_NAME": "default", "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]),
        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": run_id,
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "LEVERS9_LAUNCHER": "levers9", **({group.STORE_SECRET_VAR: gang.secret} if gang.secret else {}), **attempt_env,
    }  # fmt: skip


def _wall(when_monotonic: float) -> float:
    """A monotonic instant of this machine as wall-clock time, comparable with other nodes' reports."""
    return time.time() - (time.monotonic() - when_monotonic)


def rank_failure_of(report: Report) -> RankFailure:
    """The caller's RankFailure for a node's report of a failed rank."""
    f = report.failure
    return RankFailure(rank=report.rank, pid=report.pid, exitcode=report.exitcode if f is None else f.exitcode,
                       signal=report.signal if f is None else None,
                       exc_type=None if f is None or f.is_exit else f.exc_type, message="" if f is None else f.message,
                       traceback="" if f is None else f.traceback, output_tail=output_excerpt(list(report.tail)),
                       kind=kind_of(Outcome(report.pid, report.exitcode, report.signal, failure=f, reported=True)))  # fmt: skip


def report_of(child: Child, rank: int, node: int, address: str) -> Report:
    """A Report for a failed child, timed by its own failure record (or, for a crash, when it was seen ending)."""
    seen = child.failure.when if child.failure is not None else child.ended_at
    when = time.time() if seen is None else _wall(seen)
    return Report(rank, node, address, child.pid, child.exitcode, child.signal, child.failure, tuple(child.tail), when)


def where_on_node(board: stalls.BoardFolder, ranks: list[Child], first: int, node: int, address: str) -> str:
    """Where each live rank of this node is (collective, stack), each named by its global rank and its node."""
    live = {i: p.pid for i, p in enumerate(ranks) if p.status is None}
    return stalls.where_ranks_are(board, live, [f"rank {first + i} on node {node} ({address})" for i in range(len(ranks))])


def root_of(reports: list[Report]) -> Report:
    """The first failure in time, by outcome.root_cause's rule: failures of its own before exits, and errors
    caused only by losing a peer last."""
    return min(reports, key=lambda r: (consequence(r.failure), r.wall))


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
        """Return once every agent has joined; NodeLost naming the ones that never did after JOIN_TIMEOUT_S."""
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while True:
            missing = [i for i in self.agents if self.control.joined(i) is None]
            if not missing:
                return
            if time.monotonic() >= deadline:
                names = "; ".join(self._name(i) for i in missing)
                raise NodeLost(
                    f"distributed.run across {self.gang.describe()}: the levers9 agent of {names} never joined within "
                    f"{JOIN_TIMEOUT_S:g} s. Expected every node's agent to start; check that node in `ray status` and "
                    f"its Ray logs (the agent is a Ray task named levers9-agent), or ask for a gpu_count one node holds.",
                    self.gang.addresses[missing[0]], self._ranks_of(missing[0]),
                )
            time.sleep(POLL_EVERY_S)

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
            f"check that node (`ray status`, its kernel log for the OOM killer), then run again.",
            self.gang.addresses[node], self._ranks_of(node), kind,
        )


def _span(ranks: tuple[int, ...]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])


class _Attempt:
    """One attempt on every node: start, watch, stop, report."""

    def __init__(self, zero: _NodeZero, number: int, attempt_env: dict[str, str]) -> None:
        self.zero, self.n, self.attempt_env = zero, number, attempt_env
        self.store = zero.control
        self.gang = zero.gang
        self.watcher = Watcher(self._forward)
        self.ranks: list[Child] = []
        self.remote: dict[int, Report] = {}  # node -> its first failure
        self.done: set[int] = set()
        self.started = time.monotonic()
        self.beats: dict[int, tuple[int, float]] = {}  # node -> (last counter, when it last moved)
        self.printed: dict[int, int] = {}  # node -> the last batch of its output printed here
        self.board: stalls.BoardFolder | None = None  # node 0's ranks' board (timeout= or stall_timeout= asked)
        self.quiets: dict[int, stalls.Quiet] = {}  # node -> its ranks' last Quiet (stall_timeout=)
        self.rounds = 0  # stall confirmations asked of every node

    def _forward(self, child: Child, stream: str, line: str) -> None:
        prefix = f"[{child.name}] " if self.zero.run.prefix_output and child is not self.ranks[0] else ""
        echo.write(stream, f"{prefix}{line}\n")

    def run_it(self) -> Any:
        run, gang = self.zero.run, self.gang
        address = gang.addresses[0]
        with contextlib.ExitStack() as cleanup:  # unwound last to first: ranks stopped, store, pipes, board
            if run.diagnostics:
                self.board = stalls.BoardFolder(gang.shares[0])
                cleanup.callback(self.board.remove)
            cleanup.callback(self.watcher.close)
            port = cleanup.enter_context(hosted_store(address))  # the ranks' rendezvous store of this attempt
            cleanup.callback(self.watcher.stop, run.stop_grace)
            run_id = f"{detect.LEVERS9_RUN_ID_PREFIX}{os.getpid()}-{port}"
            sockets = socket_env(address, dict(os.environ))
            for local in range(gang.shares[0]):
                spec = RankSpec(local, gang.world_size, run.backend, None if self.board is None else str(self.board.path),
                                self.zero.job, make_group=run.make_group)  # fmt: skip
                target = RankTarget(spec, run.call if run.method.forks else run.shipped)
                env = {**run.env, **sockets,
                       **node_rank_env(local, local, gang.world_size, gang, 0, (address, port), run_id, self.attempt_env)}  # fmt: skip
                child = start.start(target, method=run.method, shipped=None if run.method.forks else ship(target),
                                    env=env, name=f"rank {local}")  # fmt: skip
                self.ranks.append(self.watcher.add(child))
            if self.board is not None:
                self.board.write_pids(os.getpid(), [p.pid for p in self.ranks])
            request = StartRequest(call=run.shipped, backend=run.backend, env=run.env, master=(address, port),
                                   run_id=run_id, attempt_env=self.attempt_env, make_group=run.make_group,
                                   stop_grace=run.stop_grace, prefix_output=run.prefix_output, forks=run.method.forks,
                                   diagnostics=run.diagnostics, stall_timeout=run.stall_timeout)  # fmt: skip
            self.store.post_start(self.n, request)
            try:
                return self._watch()
            except BaseException:
                self._stop_everywhere()
                raise

    def _poll_store(self, now: float) -> None:
        for i in self.zero.agents:
            if i not in self.remote and (report := self.store.failure(self.n, i)) is not None:
                self.remote[i] = report
            if i not in self.done and self.store.is_done(self.n, i):
                self.done.add(i)
            self._print_output_of(i)  # after the flags: a node posts its output before them
            if self.zero.run.stall_timeout is not None and (quiet := self.store.quiet(self.n, i)) is not None:
                self.quiets[i] = quiet
            count = self.store.beats(i)
            last = self.beats.get(i)
            if last is None or last[0] != count:
                self.beats[i] = (count, now)

    def _print_output_of(self, node: int) -> None:
        """Print the batches of node's rank output that arrived since the last poll, in order."""
        for seq, batch in self.store.take_output(self.n, node, self.printed.get(node, 0)):
            for stream, line in batch:
                echo.write(stream, f"{line}\n")
            self.printed[node] = seq

    def _silent(self, now: float) -> int | None:
        for i, (_, moved) in self.beats.items():
            if now - moved >= LOST_AFTER_S:
                return i
        return None

    def _watch(self) -> Any:
        timeout = self.zero.run.timeout
        deadline = None if timeout is None else self.started + timeout
        next_poll = 0.0
        first_real: float | None = None
        first_any: float | None = None
        while True:
            self.watcher.pump(0.05)
            now = time.monotonic()
            if now >= next_poll:
                self._poll_store(now)
                next_poll = now + POLL_EVERY_S
            reports = self._reports()
            if reports and first_any is None:
                first_any = now
            if first_real is None and any(not r.peer_loss for r in reports):
                first_real = now
            silent = self._silent(now)
            if silent is not None and not (first_real is not None and now - first_real >= ACROSS_NODES_WINDOW_S):
                self.zero.lost[silent] = f"its agent's heartbeat stopped for {LOST_AFTER_S:g} s"
                with contextlib.suppress(Exception):
                    self.store.declare_lost(silent)  # node 0's task cancels that agent at once
                self._stop_everywhere()
                raise self.zero._lost_error(silent, self.zero.lost[silent])
            if first_real is not None and now - first_real >= ACROSS_NODES_WINDOW_S:
                self._raise_root()
            if first_any is not None and now - first_any >= LOST_AFTER_S + 1:
                self._raise_root()  # only peer-loss errors, and every node still beats: the earliest one
            if not reports and all(p.status is not None for p in self.ranks) and self.done.issuperset(self.zero.agents):
                self.watcher.drain()
                rank0 = self.ranks[0].result
                return unship_value(rank0, "distributed.run: rank 0's return value")
            if self._stalled(now):
                stall_timeout = self.zero.run.stall_timeout
                assert stall_timeout is not None
                where = self._where()
                self._stop_everywhere()
                raise StallError(f"{stalls.stall_text(stall_timeout)}\nWhere each rank was, on every node:\n{where}")
            if deadline is not None and now >= deadline:
                where = self._where()
                self._stop_everywhere()
                raise RunTimeout(
                    f"distributed.run timed out: still running after {timeout:g} s (timeout={timeout:g}) across "
                    f"{self.gang.describe()}; every rank on every node was stopped. Expected the run to finish "
                    f"within the timeout; pass a larger timeout=, or None for no limit. Where each rank was:\n{where}"
                )

    def _stalled(self, now: float) -> bool:
        """True once every node's ranks were quiet for stall_timeout s while one waited, confirmed on fresh samples
        from every node (a node that does not answer is left to the heartbeat)."""
        stall_timeout = self.zero.run.stall_timeout
        if stall_timeout is None or self.board is None or len(self.quiets) < len(self.zero.agents):
            return False
        if not stalls.stall_of([stalls.quiet_now(self.board, now), *self.quiets.values()], stall_timeout):
            return False
        self.rounds += 1
        self.store.ask_confirm(self.n, self.rounds)
        mine = stalls.quiet_confirmed(self.board)
        theirs = self._answers(lambda i: self.store.confirmed(self.n, i, self.rounds))
        if len(theirs) < len(self.zero.agents):
            return False
        return stalls.stall_of([mine, *theirs.values()], stall_timeout)

    def _where(self) -> str:
        """Before a stall or timeout stops them: where every live rank on every node is (asked of all at once)."""
        if self.board is None:
            return "  (no report: the ranks were started without a board folder)"
        with contextlib.suppress(Exception):
            self.store.ask_where(self.n)
        texts = [where_on_node(self.board, self.ranks, 0, 0, self.gang.addresses[0])]
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
            self.watcher.pump(0.05)

    def _reports(self) -> list[Report]:
        local = [report_of(p, i, 0, self.gang.addresses[0]) for i, p in enumerate(self.ranks) if p.failed]
        return local + list(self.remote.values())

    def _stop_everywhere(self) -> None:
        """SIGTERM + stop_grace + SIGKILL for every rank on every node; returns once each live node says they are gone."""
        grace = self.zero.run.stop_grace
        with contextlib.suppress(Exception):
            self.store.ask_stop(self.n)
        self.watcher.stop(grace)
        deadline = time.monotonic() + grace + 5.0
        waiting = [i for i in self.zero.agents if i not in self.zero.lost]
        while waiting and time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                waiting = [i for i in waiting if not self.store.is_stopped(self.n, i)]
            if waiting:
                time.sleep(0.05)

    def _raise_root(self) -> NoReturn:
        root = root_of(self._reports())
        self._stop_everywhere()
        self.watcher.drain(0.3)
        if root.node == 0:  # its last lines may have arrived while stopping
            root = report_of(self.ranks[root.rank], root.rank, 0, root.address) if self.ranks[root.rank].failed else root
        failure = rank_failure_of(root)
        where = f"on node {root.node} ({root.address})"
        stopped = f"; every other rank of {self.gang.world_size} on {len(self.gang.shares)} nodes was stopped"
        full = failure.describe()
        head = full.splitlines()[0].replace(f"rank {failure.rank} (pid {failure.pid})",
                                            f"rank {failure.rank} (pid {failure.pid}) {where}", 1)  # fmt: skip
        report = root.failure
        if report is None or report.is_exit:
            raise RankCrashed(f"distributed.run: {head}{stopped}.\n\n{full}", failure)
        raise_rank_exception(f"distributed.run: {head}{stopped}.\n\n{full}", failure, report,
                             f"levers9: raised on rank {failure.rank} (pid {failure.pid}) {where} of "
                             f"{self.gang.world_size}{stopped}. Its traceback:\n{report.traceback.rstrip()}")  # fmt: skip


# ---- nodes 1..k-1: the agent ---------------------------------------------------------------------------


class _OutputSender:
    """A node's rank output, sent to node 0 in batches through the control store."""

    def __init__(self, store: ControlStore, attempt: int, node: int, prefix: bool) -> None:
        self.store, self.attempt, self.node, self.prefix = store, attempt, node, prefix
        self.lines: list[tuple[str, str]] = []

    def add(self, child: Child, stream: str, line: str) -> None:
        self.lines.append((stream, f"[{child.name}] {line}" if self.prefix else line))

    def send(self) -> None:
        if not self.lines:
            return
        batch, self.lines = self.lines, []
        self.store.send_output(self.attempt, self.node, batch)


class _Heartbeat:
    """A daemon thread that bumps node's heartbeat counter every HEARTBEAT_EVERY_S on its own store client; `.gone` once the
    control store stopped answering (node 0's task ended or its node died)."""

    def __init__(self, gang: GangContext, node: int) -> None:
        self.store = control_client(gang, timeout=LOST_AFTER_S)
        self.node = node
        self.gone = threading.Event()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="levers9-heartbeat", daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        while not self.stopping.is_set():
            try:
                self.store.beat(self.node)
            except Exception:
                self.gone.set()
                return
            self.stopping.wait(HEARTBEAT_EVERY_S)

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(5)


def serve(gang: GangContext, address: str, job: JobContext, base_env: dict[str, str], generation: int = 1,
          first_attempt: int = 0) -> None:  # fmt: skip
    """Node `gang.node_index`'s agent: join, then run each attempt's share of ranks until the job ends.

    `base_env` is what every rank of this node gets under the request's variables (its cards, the job's env=).
    A replacement agent starts at attempt `first_attempt`; an agent whose `generation` is no longer the node's
    newest (it was replaced) exits instead of starting another attempt."""
    node = gang.node_index
    store = control_client(gang)
    beat = _Heartbeat(gang, node)
    try:
        store.join(node, address)
        n = first_attempt
        while True:
            while (request := store.start_request(n)) is None:
                if beat.gone.is_set() or store.ended() or store.generation(node) != generation:
                    return
                time.sleep(0.05)
            _serve_attempt(store, beat, n, request, gang, address, job, base_env)
            n += 1
    except Exception:
        if not beat.gone.is_set():
            raise
    finally:
        beat.stop()


def _serve_attempt(store: ControlStore, beat: _Heartbeat, n: int, request: StartRequest, gang: GangContext, address: str,
                   job: JobContext, base_env: dict[str, str]) -> None:  # fmt: skip
    """Start this node's share of attempt n, supervise it, post its first failure or its end, stop on request."""
    node = gang.node_index
    method = start.choose(None if request.forks else "spawn")  # node 0 said whether ranks may fork
    call = unship(request.call) if method.forks else request.call
    out = _OutputSender(store, n, node, request.prefix_output)
    watcher = Watcher(out.add)
    ranks: list[Child] = []
    first = gang.first_rank(node)
    user_env = {**os.environ, **base_env}
    board = stalls.BoardFolder(gang.shares[node]) if request.diagnostics else None
    answers = _Answers(store, n, node, board, request.stall_timeout)
    try:
        for local in range(gang.shares[node]):
            rank = first + local
            spec = RankSpec(rank, gang.world_size, request.backend, None if board is None else str(board.path), job,
                            make_group=request.make_group, board_slot=local)  # fmt: skip
            target = RankTarget(spec, call)
            env = {**base_env, **request.env, **socket_env(address, user_env),
                   **node_rank_env(rank, local, gang.world_size, gang, node, request.master, request.run_id,
                                   request.attempt_env)}  # fmt: skip
            child = start.start(target, method=method, shipped=None if method.forks else ship(target), env=env,
                                name=f"rank {rank}")  # fmt: skip
            ranks.append(watcher.add(child))
        if board is not None:
            board.write_pids(os.getpid(), [p.pid for p in ranks])
        failed_at: float | None = None
        next_poll = 0.0
        while True:
            watcher.pump(0.05)
            now = time.monotonic()
            if failed_at is None and any(p.failed for p in ranks):
                failed_at = now
            if failed_at is not None and now - failed_at >= ROOT_CAUSE_WINDOW_S:
                watcher.drain(0.2)
                out.send()  # output first: node 0 reads it before it acts on the failure
                reports = [report_of(p, first + i, node, address) for i, p in enumerate(ranks) if p.failed]
                store.post_failure(n, node, root_of(reports))
                return
            if failed_at is None and all(p.status is not None for p in ranks):
                watcher.drain()
                out.send()
                store.post_done(n, node)
                return
            if now >= next_poll:
                next_poll = now + POLL_EVERY_S
                out.send()
                answers.post(now, lambda: where_on_node(board, ranks, first, node, address) if board else "")
                if beat.gone.is_set() or store.stop_asked(n) or store.ended():
                    return
    finally:
        watcher.stop(request.stop_grace)
        watcher.close()
        if board is not None:
            board.remove()
        with contextlib.suppress(Exception):
            store.post_stopped(n, node)


class _Answers:
    """What an agent posts about its ranks for node 0 while an attempt runs: its Quiet every poll (stall_timeout=),
    a Quiet on fresh samples for each confirmation round, and where its ranks are when asked once."""

    def __init__(self, store: ControlStore, attempt: int, node: int, board: stalls.BoardFolder | None,
                 stall_timeout: float | None) -> None:  # fmt: skip
        self.store, self.attempt, self.node, self.board, self.stall_timeout = store, attempt, node, board, stall_timeout
        self.rounds = 0
        self.told_where = False

    def post(self, now: float, where: Callable[[], str]) -> None:
        if self.board is None:
            return
        if self.stall_timeout is not None:
            self.store.post_quiet(self.attempt, self.node, stalls.quiet_now(self.board, now))
            asked = self.store.confirm_asked(self.attempt)
            if asked > self.rounds:
                self.rounds = asked
                self.store.post_confirmed(self.attempt, self.node, asked, stalls.quiet_confirmed(self.board))
        if not self.told_where and self.store.where_asked(self.attempt):
            self.told_where = True
            self.store.post_where(self.attempt, self.node, where())
