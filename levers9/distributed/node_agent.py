"""`distributed.run` across several nodes, on nodes 1..k-1: the agent that starts and watches this node's share.

Node i's agent runs for the whole job (in a Ray task, levers9/launch/ray/gang.py, or a `levers9 run` launcher):
it joins the job's control store, beats its heartbeat, and for each attempt node 0 posts starts global ranks
first_rank(i).. through a rank set under one Supervisor, sends their output to node 0 in pieces, and posts
their first failure (root cause first) or their end; node 0's side is nodes.py.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Literal

from levers9.distributed import stalls
from levers9.distributed.control_store import ControlStore, Piece, StartRequest
from levers9.distributed.nodes import (
    AHEAD,
    ANSWER_WAIT_S,
    HEARTBEAT_EVERY_S,
    LOST_AFTER_S,
    POLL_EVERY_S,
    SEND_BYTES,
    control_client,
    report_of,
    socket_env,
    where_on_node,
)
from levers9.distributed.rank_set import RankSet, Share, rank_vars
from levers9.procs import start
from levers9.procs.failure import unship
from levers9.procs.outcome import StopReason, root_cause
from levers9.runtime import GangContext, JobContext

AgentEnd = Literal["ok", "failed", "lost", "replaced"]


class _OutputSender:
    """A node's rank output, sent to node 0 in batches of pieces through the control store: on each poll, and at
    once from the output thread when a batch holds SEND_BYTES, then waiting (at most ANSWER_WAIT_S) while node 0
    has not taken the batch AHEAD before it, so a long line never waits whole anywhere. Its own store client: two
    threads send."""

    def __init__(self, gang: GangContext, attempt: int) -> None:
        self.store = control_client(gang)
        self.attempt, self.node = attempt, gang.node_index
        self.lock = threading.Lock()
        self.pieces: list[Piece] = []
        self.size = 0

    def add(self, rank: int, stream: str, text: str) -> None:
        with self.lock:
            self.pieces.append((rank, stream, text))
            self.size += len(text)
            if self.size < SEND_BYTES:
                return
            seq = self._send()
        deadline = time.monotonic() + ANSWER_WAIT_S  # the lock is free meanwhile: the agent's loop sends and polls
        while time.monotonic() < deadline:
            with self.lock:
                if self.store.output_taken(self.attempt, self.node, seq - AHEAD):
                    return
            time.sleep(0.02)

    def send(self) -> None:
        with self.lock:
            self._send()

    def _send(self) -> int:
        if not self.pieces:
            return 0
        batch, self.pieces, self.size = self.pieces, [], 0
        return self.store.send_output(self.attempt, self.node, batch)


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
          first_attempt: int = 0) -> AgentEnd:  # fmt: skip
    """Node `gang.node_index`'s agent: join, then run each attempt's share of ranks until the job ends.

    `base_env` is what every rank of this node gets under the request's variables (its cards, the job's env=).
    A replacement agent starts at attempt `first_attempt`; an agent whose `generation` is no longer the node's
    newest (it was replaced) exits instead of starting another attempt. Returns how the job ended for this node:
    "ok" or "failed" as node 0 said, "lost" when node 0's store stopped answering first, "replaced"."""
    node = gang.node_index
    store = control_client(gang)
    beat = _Heartbeat(gang, node)
    try:
        store.join(node, address)
        n = first_attempt
        while True:
            while (request := store.start_request(n)) is None:
                if beat.gone.is_set():
                    return "lost"
                if store.ended():
                    return "failed" if store.ended_failed() else "ok"
                if store.generation(node) != generation:
                    return "replaced"
                time.sleep(0.05)
            _serve_attempt(store, beat, n, request, gang, address, job, base_env)
            n += 1
    except Exception:
        if beat.gone.is_set() or not _answers(store):  # the store went away mid-attempt, before the heartbeat saw it
            return "lost"
        raise
    finally:
        beat.stop()


def _answers(store: ControlStore) -> bool:
    """True while node 0's store still answers this agent."""
    try:
        store.ended()
        return True
    except Exception:
        return False


def _serve_attempt(store: ControlStore, beat: _Heartbeat, n: int, request: StartRequest, gang: GangContext, address: str,
                   job: JobContext, base_env: dict[str, str]) -> None:  # fmt: skip
    """Start this node's share of attempt n, supervise it, post its first failure or its end, stop on request."""
    node = gang.node_index
    method = start.choose(None if request.forks else "spawn")  # node 0 said whether ranks may fork
    out = _OutputSender(gang, n)
    ranks = RankSet(out.add)
    first = gang.first_rank(node)
    sockets = socket_env(address, {**os.environ, **base_env})
    board = stalls.BoardFolder(gang.shares[node]) if request.diagnostics else None
    answers = _Answers(store, n, node, board, request.stall_timeout)

    def env_of(rank: int) -> dict[str, str]:
        return {**base_env, **request.env, **sockets, **rank_vars(rank, gang.world_size, request.master[1],
                addr=request.master[0], run_id=request.run_id, shares=gang.shares, node=node, secret=gang.secret),
                **request.attempt_env}  # fmt: skip

    def where() -> str:
        return "" if board is None else where_on_node(board, ranks.children, first, node, address)

    def post_root() -> None:  # output first: node 0 reads it before it acts on the failure
        failed = [i for i, p in enumerate(ranks.children) if p.failed]
        if failed and not posted:
            posted.append(True)
            root = root_cause([supervisor.outcome_of(ranks.children[i]) for i in failed])
            i = next(i for i in failed if ranks.children[i].pid == root.pid)
            out.send()
            store.post_failure(n, node, report_of(ranks.children[i], first + i, node, address))

    def each_poll(now: float) -> None:
        out.send()
        answers.post(now, where)

    asked = _StopAsked(store, beat, n, each_poll)
    posted: list[bool] = []
    try:
        ranks.start(Share(first, gang.shares[node], gang.world_size, request.backend,
                          unship(request.call) if method.forks else request.call, method, env_of,
                          None if board is None else str(board.path), job, make_group=request.make_group,
                          board_slots=True))  # fmt: skip
        if board is not None:
            board.write_pids(os.getpid(), [p.pid for p in ranks.children])
        supervisor = ranks.supervisor(timeout=None, grace=request.stop_grace, should_stop=asked,
                                      before_stop=lambda reason: post_root() if reason is StopReason.SIBLING else None)  # fmt: skip
        outcomes = supervisor.run()
        post_root()  # every rank ended before the window passed
        if supervisor.stopped_for is None and all(o.succeeded for o in outcomes):
            out.send()
            store.post_done(n, node)
    finally:
        ranks.stop(request.stop_grace)
        ranks.close()
        if board is not None:
            board.remove()
        with contextlib.suppress(Exception):
            out.send()  # the last of it: node 0 prints it once this node's ranks are stopped
            store.post_stopped(n, node)


class _StopAsked:
    """An agent's should_stop: every POLL_EVERY_S, `each_poll(now)` (send output, post answers), then True once node 0
    asked this attempt's ranks to stop, the job ended, or the control store is gone."""

    def __init__(self, store: ControlStore, beat: _Heartbeat, attempt: int, each_poll: Callable[[float], None]) -> None:
        self.store, self.beat, self.attempt, self.each_poll = store, beat, attempt, each_poll
        self.next_poll = 0.0
        self.asked = False

    def __call__(self) -> bool:
        now = time.monotonic()
        if not self.asked and now >= self.next_poll:
            self.next_poll = now + POLL_EVERY_S
            self.each_poll(now)
            self.asked = self.beat.gone.is_set() or self.store.stop_asked(self.attempt) or self.store.ended()
        return self.asked


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
