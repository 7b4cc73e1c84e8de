"""`distributed.run` across several nodes: node 0 starts its share of ranks, each node's agent starts its own.

A job that holds cards on several Ray nodes (levers9/launch/ray_gang.py) runs its function on node 0
with a GangContext. There, `run_across_nodes` hosts the ranks' rendezvous store on node 0's address
(a port it bound itself, fresh for every attempt), starts global ranks 0..share-1, and posts one
start request into the job's control store; the agent on node i (`serve`, in its Ray task) starts
global ranks first_rank(i).. with torchrun's full variable set, supervises them with levers9.procs
and posts the first failure of its node. Node 0 treats those reports as it treats its own ranks'
(root cause first in time, peer-loss errors last), and declares a node lost when its agent's
heartbeat counter stopped moving for LOST_AFTER_S. Nothing here imports Ray.

Control store keys (all under the job's control store, hosted by node 0's Ray task):
    ready/<i>            agent i joined (its address)         hb/<i>        agent i's heartbeat counter
    attempts             how many attempts node 0 started (each distributed.run call and restart is one)
    a<n>/start           attempt n's start request            a<n>/stop     stop attempt n's ranks now
    a<n>/fail/<i>        node i's first failure (shipped)     a<n>/done/<i> node i's ranks all returned
    a<n>/stopped/<i>     node i's ranks of attempt n are gone  end          the job is over: agents exit
    a<n>/out/<i>/count   batches of node i's rank output       a<n>/out/<i>/<seq>  one batch (node 0 prints, deletes)
    lost/<i>             node 0 declared node i lost (its agent is cancelled without waiting)
    replace/<i>          node 0 asks node 0's Ray task for a new agent for lost node i (value: the attempt it starts at)
    gen/<i>              the generation of node i's agent (one more per replacement); an older agent exits
    noreplace/<i>        no replacement came within the wait (value: why)
    a<n>/quiet/<i>       node i's ranks' Quiet (stall_timeout=): how long nothing moved, whether one waits
    a<n>/confirm         node 0 asks every node for a Quiet on fresh samples (value: the round)
    a<n>/confirmed/<i>/<round>  node i's answer          a<n>/where   node 0 asks where every rank is
    a<n>/where/<i>       node i's answer: its ranks' collectives and stacks, named by global rank and node

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
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

from levers9.context import GangContext, JobContext, current_job
from levers9.distributed import detect, group, restarts, stalls
from levers9.distributed.rank_process import RankSpec, RankTarget
from levers9.errors import (
    ConfigError,
    FailureKind,
    NodeLost,
    RankCrashed,
    RankFailure,
    RunTimeout,
    StallError,
)
from levers9.procs import start
from levers9.procs.failure import Failure, raise_rank_exception, ship, unship, unship_value
from levers9.procs.outcome import Outcome, kind_of
from levers9.procs.watch import Child, Watcher, exit_on_terminate
from levers9.retries import RetryPolicy

log = logging.getLogger("levers9.distributed")

HEARTBEAT_EVERY_S = 0.5  # an agent bumps its counter this often
LOST_AFTER_S = 5.0  # a counter that did not move for this long: the node is lost
JOIN_TIMEOUT_S = 120.0  # agents that have not joined by then are named
POLL_EVERY_S = 0.1  # node 0 reads the control store this often
ROOT_CAUSE_WINDOW_S = 0.15  # as on one node: an agent waits this long for an earlier failure of its own ranks
# node 0 waits longer: an agent's report of an earlier failure is on its way (its window, then node 0's poll)
ACROSS_NODES_WINDOW_S = ROOT_CAUSE_WINDOW_S + 2 * POLL_EVERY_S + 0.15
REPORT_LINES = 40
ANSWER_WAIT_S = 10.0  # how long node 0 waits for the other nodes' fresh samples and stack reports
SOCKET_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def control_client(gang: GangContext, timeout: float = 30.0) -> Any:
    """A client of the job's control store, under the job's secret (`control_prefix`)."""
    import torch.distributed as td

    client = td.TCPStore(gang.control_addr, gang.control_port, None, False, datetime.timedelta(seconds=timeout))
    return control_prefix(client, gang.secret)


def control_prefix(store: Any, secret: str) -> Any:
    """`store` with every key under `secret`: the control store listens on the cluster network, and its values
    are unpickled, so a key only the job's processes can name is one nobody else can set."""
    import torch.distributed as td

    return td.PrefixStore(f"levers9-{secret}", store) if secret else store  # keys: levers9-<secret>/<key>


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


@dataclasses.dataclass(frozen=True)
class Report:
    """One failed rank, as a node reports it: enough for the caller's RankFailure and for ordering."""

    rank: int
    node: int
    address: str
    pid: int
    exitcode: int | None
    signal: int | None
    failure: Failure | None
    tail: tuple[str, ...]
    wall: float  # when it failed (wall clock): the root cause is the earliest

    @property
    def peer_loss(self) -> bool:
        return self.failure is not None and self.failure.peer_loss

    def rank_failure(self) -> RankFailure:
        f = self.failure
        return RankFailure(rank=self.rank, pid=self.pid, exitcode=self.exitcode if f is None else f.exitcode,
                           signal=self.signal if f is None else None,
                           exc_type=None if f is None or f.is_exit else f.exc_type, message="" if f is None else f.message,
                           traceback="" if f is None else f.traceback, output_tail=_excerpt(list(self.tail)),
                           kind=kind_of(Outcome(self.pid, self.exitcode, self.signal, failure=f, reported=True)))  # fmt: skip


def _excerpt(lines: list[str]) -> str:
    starts = [i for i, line in enumerate(lines) if line.startswith("Fatal Python error")]
    if starts:
        return "\n".join(lines[starts[-1] : starts[-1] + REPORT_LINES])
    return "\n".join(lines[-REPORT_LINES:])


def report_of(child: Child, rank: int, node: int, address: str) -> Report:
    """A Report for a failed child, timed by its own failure record (or now, for a crash)."""
    when = time.time() if child.failure is None else _wall(child.failure.when)
    return Report(rank, node, address, child.pid, child.exitcode, child.signal, child.failure, tuple(child.tail), when)


def where_on_node(board: stalls.BoardFolder, ranks: list[Child], first: int, node: int, address: str) -> str:
    """Where each live rank of this node is (collective, stack), each named by its global rank and its node."""
    live = {i: p.pid for i, p in enumerate(ranks) if p.status is None}
    return stalls.where_ranks_are(board, live, [f"rank {first + i} on node {node} ({address})" for i in range(len(ranks))])


def root_of(reports: list[Report]) -> Report:
    """The first failure in time; errors caused only by losing a peer come last."""
    return min(reports, key=lambda r: (r.peer_loss, r.wall))


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
        self.store: Any = None
        self.lost: dict[int, str] = {}  # node -> why, once declared lost

    def forget_store(self) -> None:
        self.store = None

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
            missing = [i for i in self.agents if not self.store.check([f"ready/{i}"])]
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
        n = int(self.store.add("attempts", 1)) - 1  # counted in the store: a job may call distributed.run again
        for i in self.agents:
            if i not in self.lost and self.store.check([f"lost/{i}"]):
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
            for key in (f"ready/{i}", f"noreplace/{i}"):
                self.store.delete_key(key)
            self.store.set(f"replace/{i}", str(n))
        log.warning("distributed.run across %s: waiting up to %g s for a node to replace %s",
                    self.gang.describe(), within, "; ".join(self._name(i) for i in waiting))  # fmt: skip
        deadline = time.monotonic() + within + ANSWER_WAIT_S  # node 0's Ray task posts noreplace/<i> at `within`
        while waiting:
            for i in list(waiting):
                if self.store.check([f"ready/{i}"]):
                    address = self.store.get(f"ready/{i}").decode()
                    old = self._name(i)
                    self._moved(i, address)
                    self.store.delete_key(f"lost/{i}")
                    del self.lost[i]
                    waiting.remove(i)
                    log.warning("distributed.run: %s is replaced by %s", old, self._name(i))
                    continue
                why = self.store.get(f"noreplace/{i}").decode() if self.store.check([f"noreplace/{i}"]) else None
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


def hosted_rank_store(host: str) -> Any:
    """The ranks' rendezvous store of one attempt, on `host` (node 0's Ray address), on a port bound here."""
    from levers9.distributed.spawner import hosted_store

    return hosted_store(host)


class _Attempt:
    """One attempt on every node: start, watch, stop, report."""

    def __init__(self, zero: _NodeZero, number: int, attempt_env: dict[str, str]) -> None:
        self.zero, self.n, self.attempt_env = zero, number, attempt_env
        self.store = zero.store
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
        out = sys.stdout if stream == "stdout" else sys.stderr
        out.write(f"{prefix}{line}\n")
        out.flush()

    def run_it(self) -> Any:
        run, gang = self.zero.run, self.gang
        address = gang.addresses[0]
        with contextlib.ExitStack() as cleanup:  # unwound last to first: ranks stopped, store, pipes, board
            if run.diagnostics:
                self.board = stalls.BoardFolder(gang.shares[0])
                cleanup.callback(self.board.remove)
            cleanup.callback(self.watcher.close)
            port = cleanup.enter_context(hosted_rank_store(address))
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
            request = {"call": run.shipped, "backend": run.backend, "env": run.env, "master": (address, port),
                       "run_id": run_id, "attempt_env": self.attempt_env, "make_group": run.make_group,
                       "stop_grace": run.stop_grace, "prefix_output": run.prefix_output, "forks": run.method.forks,
                       "diagnostics": run.diagnostics, "stall_timeout": run.stall_timeout}  # fmt: skip
            self.store.set(f"a{self.n}/start", ship(request))
            try:
                return self._watch()
            except BaseException:
                self._stop_everywhere()
                raise

    def _poll_store(self, now: float) -> None:
        for i in self.zero.agents:
            if i not in self.remote and self.store.check([f"a{self.n}/fail/{i}"]):
                self.remote[i] = unship(self.store.get(f"a{self.n}/fail/{i}"))
            if i not in self.done and self.store.check([f"a{self.n}/done/{i}"]):
                self.done.add(i)
            self._print_output_of(i)  # after the flags: a node posts its output before them
            if self.zero.run.stall_timeout is not None and self.store.check([f"a{self.n}/quiet/{i}"]):
                self.quiets[i] = unship(self.store.get(f"a{self.n}/quiet/{i}"))
            count = int(self.store.add(f"hb/{i}", 0))
            last = self.beats.get(i)
            if last is None or last[0] != count:
                self.beats[i] = (count, now)

    def _print_output_of(self, node: int) -> None:
        """Print the batches of node's rank output that arrived since the last poll, in order."""
        key = f"a{self.n}/out/{node}"
        count = int(self.store.add(f"{key}/count", 0))
        while self.printed.get(node, 0) < count:
            seq = self.printed.get(node, 0) + 1
            if not self.store.check([f"{key}/{seq}"]):
                return  # numbered but not written yet: the next poll reads it
            for stream, line in unship(self.store.get(f"{key}/{seq}")):
                out = sys.stdout if stream == "stdout" else sys.stderr
                out.write(f"{line}\n")
            sys.stdout.flush()
            sys.stderr.flush()
            self.store.delete_key(f"{key}/{seq}")
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
                    self.store.set(f"lost/{silent}", "1")  # node 0's task cancels that agent at once
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
        self.store.set(f"a{self.n}/confirm", str(self.rounds))
        mine = stalls.quiet_confirmed(self.board)
        theirs = self._answers(lambda i: f"a{self.n}/confirmed/{i}/{self.rounds}")
        if len(theirs) < len(self.zero.agents):
            return False
        return stalls.stall_of([mine, *(unship(answer) for answer in theirs.values())], stall_timeout)

    def _where(self) -> str:
        """Before a stall or timeout stops them: where every live rank on every node is (asked of all at once)."""
        if self.board is None:
            return "  (no report: the ranks were started without a board folder)"
        with contextlib.suppress(Exception):
            self.store.set(f"a{self.n}/where", "1")
        texts = [where_on_node(self.board, self.ranks, 0, 0, self.gang.addresses[0])]
        answers = self._answers(lambda i: f"a{self.n}/where/{i}")
        for i in self.zero.agents:
            texts.append(answers[i].decode() if i in answers else f"  {self.zero._name(i)}: did not answer")
        return "\n\n".join(texts)

    def _answers(self, key_of: Callable[[int], str]) -> dict[int, bytes]:
        """Each other node's value at key_of(node), waited for up to ANSWER_WAIT_S; the nodes that did not answer are left out."""
        answers: dict[int, bytes] = {}
        deadline = time.monotonic() + ANSWER_WAIT_S
        while True:
            for i in self.zero.agents:
                with contextlib.suppress(Exception):
                    if i not in answers and self.store.check([key_of(i)]):
                        answers[i] = self.store.get(key_of(i))
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
            self.store.set(f"a{self.n}/stop", "1")
        self.watcher.stop(grace)
        deadline = time.monotonic() + grace + 5.0
        waiting = [i for i in self.zero.agents if i not in self.zero.lost]
        while waiting and time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                waiting = [i for i in waiting if not self.store.check([f"a{self.n}/stopped/{i}"])]
            if waiting:
                time.sleep(0.05)

    def _raise_root(self) -> NoReturn:
        root = root_of(self._reports())
        self._stop_everywhere()
        self.watcher.drain(0.3)
        if root.node == 0:  # its last lines may have arrived while stopping
            root = report_of(self.ranks[root.rank], root.rank, 0, root.address) if self.ranks[root.rank].failed else root
        failure = root.rank_failure()
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
    """A node's rank output, sent to node 0 in batches through the control store (a<n>/out/<i>/<seq>)."""

    def __init__(self, store: Any, attempt: int, node: int, prefix: bool) -> None:
        self.store, self.key, self.prefix = store, f"a{attempt}/out/{node}", prefix
        self.lines: list[tuple[str, str]] = []

    def add(self, child: Child, stream: str, line: str) -> None:
        self.lines.append((stream, f"[{child.name}] {line}" if self.prefix else line))

    def send(self) -> None:
        if not self.lines:
            return
        batch, self.lines = self.lines, []
        seq = int(self.store.add(f"{self.key}/count", 1))
        self.store.set(f"{self.key}/{seq}", ship(batch))


class _Heartbeat:
    """A daemon thread that bumps hb/<node> every HEARTBEAT_EVERY_S on its own store client; `.gone` once the
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
                self.store.add(f"hb/{self.node}", 1)
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
        store.set(f"ready/{node}", address)
        n = first_attempt
        while True:
            while not store.check([f"a{n}/start"]):
                if beat.gone.is_set() or store.check(["end"]) or int(store.add(f"gen/{node}", 0)) != generation:
                    return
                time.sleep(0.05)
            request = unship(store.get(f"a{n}/start"))
            _serve_attempt(store, beat, n, request, gang, address, job, base_env)
            n += 1
    except Exception:
        if not beat.gone.is_set():
            raise
    finally:
        beat.stop()


def _serve_attempt(store: Any, beat: _Heartbeat, n: int, request: dict[str, Any], gang: GangContext, address: str,
                   job: JobContext, base_env: dict[str, str]) -> None:  # fmt: skip
    """Start this node's share of attempt n, supervise it, post its first failure or its end, stop on request."""
    node = gang.node_index
    method = start.choose(None if request.get("forks", True) else "spawn")  # node 0 said whether ranks may fork
    call = unship(request["call"]) if method.forks else request["call"]
    out = _OutputSender(store, n, node, bool(request.get("prefix_output", True)))
    watcher = Watcher(out.add)
    ranks: list[Child] = []
    first = gang.first_rank(node)
    user_env = {**os.environ, **base_env}
    board = stalls.BoardFolder(gang.shares[node]) if request.get("diagnostics") else None
    answers = _Answers(store, n, node, board, request.get("stall_timeout"))
    try:
        for local in range(gang.shares[node]):
            rank = first + local
            spec = RankSpec(rank, gang.world_size, request["backend"], None if board is None else str(board.path), job,
                            make_group=request["make_group"], board_slot=local)  # fmt: skip
            target = RankTarget(spec, call)
            env = {**base_env, **request["env"], **socket_env(address, user_env),
                   **node_rank_env(rank, local, gang.world_size, gang, node, tuple(request["master"]), request["run_id"],
                                   request["attempt_env"])}  # fmt: skip
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
                store.set(f"a{n}/fail/{node}", ship(root_of(reports)))
                return
            if failed_at is None and all(p.status is not None for p in ranks):
                watcher.drain()
                out.send()
                store.set(f"a{n}/done/{node}", "1")
                return
            if now >= next_poll:
                next_poll = now + POLL_EVERY_S
                out.send()
                answers.post(now, lambda: where_on_node(board, ranks, first, node, address) if board else "")
                if beat.gone.is_set() or store.check([f"a{n}/stop"]) or store.check(["end"]):
                    return
    finally:
        watcher.stop(float(request["stop_grace"]))
        watcher.close()
        if board is not None:
            board.remove()
        with contextlib.suppress(Exception):
            store.set(f"a{n}/stopped/{node}", "1")


class _Answers:
    """What an agent posts about its ranks for node 0 while an attempt runs: its Quiet every poll (stall_timeout=),
    a Quiet on fresh samples for each confirmation round, and where its ranks are when asked once."""

    def __init__(self, store: Any, attempt: int, node: int, board: stalls.BoardFolder | None, stall_timeout: float | None) -> None:
        self.store, self.key, self.node, self.board, self.stall_timeout = store, f"a{attempt}", node, board, stall_timeout
        self.rounds = 0
        self.told_where = False

    def post(self, now: float, where: Callable[[], str]) -> None:
        if self.board is None:
            return
        if self.stall_timeout is not None:
            self.store.set(f"{self.key}/quiet/{self.node}", ship(stalls.quiet_now(self.board, now)))
            asked = int(self.store.get(f"{self.key}/confirm")) if self.store.check([f"{self.key}/confirm"]) else 0
            if asked > self.rounds:
                self.rounds = asked
                self.store.set(f"{self.key}/confirmed/{self.node}/{asked}", ship(stalls.quiet_confirmed(self.board)))
        if not self.told_where and self.store.check([f"{self.key}/where"]):
            self.told_where = True
            self.store.set(f"{self.key}/where/{self.node}", where())
