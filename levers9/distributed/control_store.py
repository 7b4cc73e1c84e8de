"""The protocol between the nodes of one `distributed.run` across Ray nodes: every key of the job's control store.

Node 0's Ray task hosts the store (levers9/launch/ray/gang.py); node 0's job process and each node's agent
(levers9/distributed/nodes.py) are its clients. Nothing else names a key: each family below is written and read
through one typed method of `ControlStore`, and what crosses as more than a flag is a frozen value
(`StartRequest`, `Report`, a stall board's `Quiet`, batches of output lines). `store` is any object with the
torch `Store` methods used here (set, get, check, add, delete_key); `get` is only called on a key `check` found.

    ready/<i>            agent i joined (its address)         hb/<i>        agent i's heartbeat counter
    attempts             how many attempts node 0 started (each distributed.run call and restart is one)
    a<n>/start           attempt n's StartRequest                a<n>/stop     stop attempt n's ranks now
    a<n>/fail/<i>        node i's first failure (a Report)      a<n>/done/<i> node i's ranks all returned
    a<n>/stopped/<i>     node i's ranks of attempt n are gone   end           the job is over: agents exit (value:
                                                                              "ok", or "failed" when node 0 raised)
    a<n>/out/<i>/count   batches of node i's rank output        a<n>/out/<i>/<seq>  one batch of pieces (node 0 prints, deletes)
    lost/<i>             node 0 declared node i lost (its agent is cancelled without waiting)
    replace/<i>          node 0 asks node 0's Ray task for a new agent for lost node i (value: the attempt it starts at)
    gen/<i>              the generation of node i's agent (one more per replacement); an older agent exits
    noreplace/<i>        no replacement came within the wait (value: why)
    a<n>/quiet/<i>       node i's ranks' Quiet (stall_timeout=): how long nothing moved, whether one waits
    a<n>/confirm         node 0 asks every node for a Quiet on fresh samples (value: the round)
    a<n>/confirmed/<i>/<round>  node i's answer           a<n>/where    node 0 asks where every rank is
    a<n>/where/<i>       node i's answer: its ranks' collectives and stacks, named by global rank and node
    rendezvous           `levers9 run --nnodes` (torchrun_nodes.py): the host's run id, ranks per node, node count
    rendezvous/joined    how many launchers took a node number by c10d rendezvous (each takes the next one)
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import logging
import os
import socket
from collections.abc import Iterator
from typing import Any, Protocol

from levers9.distributed.stalls import Quiet
from levers9.procs.failure import FailureRecord, ship, unship


class Store(Protocol):
    """The methods of torch.distributed.Store this protocol uses."""

    def set(self, key: str, value: Any) -> None: ...  # str or bytes (torch types it str)
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def add(self, key: str, amount: int) -> int: ...
    def delete_key(self, key: str) -> bool: ...


@dataclasses.dataclass(frozen=True)
class StartRequest:
    """What node 0 tells every agent to start for one attempt: fn, the ranks' variables, how to run and report."""

    call: bytes  # fn bound to cfg, pickled by value
    backend: str
    env: dict[str, str]  # quirk defaults etc. from node 0's plan, for every rank
    master: tuple[str, int]  # the ranks' rendezvous store, on node 0
    run_id: str
    attempt_env: dict[str, str]  # the restart count and its limit
    make_group: bool
    stop_grace: float
    prefix_output: bool
    forks: bool  # node 0 forks its ranks: the agents may too
    diagnostics: bool  # each node's ranks get a board folder
    stall_timeout: float | None


Piece = tuple[int, str, str]  # (global rank, "stdout" or "stderr", a line with its "\n", or a piece of a long one)


@dataclasses.dataclass(frozen=True)
class Report:
    """One failed rank, as a node reports it: enough for the caller's RankFailure (nodes.rank_failure_of)."""

    rank: int
    node: int
    address: str
    pid: int
    exitcode: int | None
    signal: int | None
    failure: FailureRecord | None
    tail: tuple[str, ...]
    wall: float  # when it failed (wall clock): the root cause is the earliest

    @property
    def peer_loss(self) -> bool:
        return self.failure is not None and self.failure.peer_loss


class ControlStore:
    """The job's control store, one method per thing a node says or asks; None where it was not said yet."""

    def __init__(self, store: Store) -> None:
        self.store = store

    @classmethod
    def under_secret(cls, store: Store, secret: str) -> ControlStore:
        """The protocol with every key under `secret`: the store listens on the cluster network and its values are
        unpickled, so a key only the job's own processes can name (Ray hands them the secret) is one nobody else
        can set."""
        if not secret:
            return cls(store)
        import torch.distributed as td

        return cls(td.PrefixStore(f"levers9-{secret}", store))  # type: ignore[arg-type]  # keys: levers9-<secret>/<key>

    def _read(self, key: str) -> bytes | None:
        return self.store.get(key) if self.store.check([key]) else None

    def _text(self, key: str) -> str | None:
        value = self._read(key)
        return None if value is None else value.decode()

    def _value(self, key: str) -> Any:
        value = self._read(key)
        return None if value is None else unship(value)

    def _flag(self, key: str) -> bool:
        return bool(self.store.check([key]))

    # ---- the agents: joining, heartbeat, loss and replacement, the job's end

    def join(self, node: int, address: str) -> None:
        self.store.set(f"ready/{node}", address)

    def joined(self, node: int) -> str | None:
        """The address node's agent joined from, None while it has not."""
        return self._text(f"ready/{node}")

    def beat(self, node: int) -> None:
        self.store.add(f"hb/{node}", 1)

    def beats(self, node: int) -> int:
        return int(self.store.add(f"hb/{node}", 0))

    def next_attempt(self) -> int:
        """The number of the attempt node 0 starts now, counted across the job's distributed.run calls (0 first)."""
        return int(self.store.add("attempts", 1)) - 1

    def declare_lost(self, node: int) -> None:
        self.store.set(f"lost/{node}", "1")

    def is_lost(self, node: int) -> bool:
        return self._flag(f"lost/{node}")

    def ask_replacement(self, node: int, attempt: int) -> None:
        """Ask for a new agent of lost `node`, starting at `attempt`; its old join and refusal are forgotten first."""
        for key in (f"ready/{node}", f"noreplace/{node}"):
            self.store.delete_key(key)
        self.store.set(f"replace/{node}", str(attempt))

    def take_replacement(self, node: int) -> int | None:
        """The attempt a replacement of `node` was asked to start at (the ask is taken), None if none was asked."""
        value = self._read(f"replace/{node}")
        if value is None:
            return None
        self.store.delete_key(f"replace/{node}")
        return int(value)

    def replaced(self, node: int) -> None:
        """Lost `node` has an agent again."""
        self.store.delete_key(f"lost/{node}")

    def refuse_replacement(self, node: int, why: str) -> None:
        self.store.set(f"noreplace/{node}", why)

    def replacement_refused(self, node: int) -> str | None:
        return self._text(f"noreplace/{node}")

    def new_generation(self, node: int) -> int:
        """The generation of the agent launched now for `node` (1 for the first)."""
        return int(self.store.add(f"gen/{node}", 1))

    def generation(self, node: int) -> int:
        return int(self.store.add(f"gen/{node}", 0))

    def end(self, failed: bool = False) -> None:
        self.store.set("end", "failed" if failed else "ok")

    def ended(self) -> bool:
        return self._flag("end")

    def ended_failed(self) -> bool:
        """True once node 0 ended the job because its run raised (a rank failed, a node was lost, ...)."""
        return self._text("end") == "failed"

    # ---- `levers9 run --nnodes`: the launchers meet (levers9/distributed/torchrun_nodes.py)

    def open_rendezvous(self, layout: tuple[str, int, int]) -> None:
        """The host says what every launcher must agree on: (run id, ranks per node, nodes)."""
        self.store.set("rendezvous", ship(layout))

    def rendezvous(self) -> tuple[str, int, int] | None:
        return self._value("rendezvous")

    def next_node(self) -> int:
        """The node number of a launcher joining by c10d rendezvous: 1, 2, ... in the order they join (the host is 0)."""
        return int(self.store.add("rendezvous/joined", 1))

    # ---- one attempt: start, output, outcome, stop

    def post_start(self, attempt: int, request: StartRequest) -> None:
        self.store.set(f"a{attempt}/start", ship(request))

    def start_request(self, attempt: int) -> StartRequest | None:
        return self._value(f"a{attempt}/start")

    def send_output(self, attempt: int, node: int, batch: list[Piece]) -> int:
        """One batch of node's output pieces, numbered after the ones before it; its number."""
        key = f"a{attempt}/out/{node}"
        seq = int(self.store.add(f"{key}/count", 1))
        self.store.set(f"{key}/{seq}", ship(batch))
        return seq

    def output_taken(self, attempt: int, node: int, seq: int) -> bool:
        """True once node 0 took node's batch number `seq` (or it was never sent)."""
        return not self.store.check([f"a{attempt}/out/{node}/{seq}"])

    def take_output(self, attempt: int, node: int, after: int) -> Iterator[tuple[int, list[Piece]]]:
        """(number, batch) for node's batches numbered after `after`, in order, each deleted once the next is
        asked for; stops at the first one numbered but not written yet."""
        key = f"a{attempt}/out/{node}"
        count = int(self.store.add(f"{key}/count", 0))
        for seq in range(after + 1, count + 1):
            value = self._read(f"{key}/{seq}")
            if value is None:
                return
            yield seq, unship(value)
            self.store.delete_key(f"{key}/{seq}")

    def post_failure(self, attempt: int, node: int, report: Report) -> None:
        self.store.set(f"a{attempt}/fail/{node}", ship(report))

    def failure(self, attempt: int, node: int) -> Report | None:
        return self._value(f"a{attempt}/fail/{node}")

    def post_done(self, attempt: int, node: int) -> None:
        self.store.set(f"a{attempt}/done/{node}", "1")

    def is_done(self, attempt: int, node: int) -> bool:
        return self._flag(f"a{attempt}/done/{node}")

    def ask_stop(self, attempt: int) -> None:
        self.store.set(f"a{attempt}/stop", "1")

    def stop_asked(self, attempt: int) -> bool:
        return self._flag(f"a{attempt}/stop")

    def post_stopped(self, attempt: int, node: int) -> None:
        self.store.set(f"a{attempt}/stopped/{node}", "1")

    def is_stopped(self, attempt: int, node: int) -> bool:
        return self._flag(f"a{attempt}/stopped/{node}")

    # ---- one attempt: stalls and where the ranks are

    def post_quiet(self, attempt: int, node: int, quiet: Quiet) -> None:
        self.store.set(f"a{attempt}/quiet/{node}", ship(quiet))

    def quiet(self, attempt: int, node: int) -> Quiet | None:
        return self._value(f"a{attempt}/quiet/{node}")

    def ask_confirm(self, attempt: int, round_: int) -> None:
        self.store.set(f"a{attempt}/confirm", str(round_))

    def confirm_asked(self, attempt: int) -> int:
        """The latest confirmation round node 0 asked for, 0 if none."""
        value = self._read(f"a{attempt}/confirm")
        return 0 if value is None else int(value)

    def post_confirmed(self, attempt: int, node: int, round_: int, quiet: Quiet) -> None:
        self.store.set(f"a{attempt}/confirmed/{node}/{round_}", ship(quiet))

    def confirmed(self, attempt: int, node: int, round_: int) -> Quiet | None:
        return self._value(f"a{attempt}/confirmed/{node}/{round_}")

    def ask_where(self, attempt: int) -> None:
        self.store.set(f"a{attempt}/where", "1")

    def where_asked(self, attempt: int) -> bool:
        return self._flag(f"a{attempt}/where")

    def post_where(self, attempt: int, node: int, text: str) -> None:
        self.store.set(f"a{attempt}/where/{node}", text)

    def where(self, attempt: int, node: int) -> str | None:
        return self._text(f"a{attempt}/where/{node}")


log = logging.getLogger("levers9.distributed")


def serve_store(host: str, port: int = 0) -> tuple[Any, int]:
    """(the store, its port): a TCPStore server listening on `host` alone, on `port` (0: one the kernel picks, so
    nothing collides), bound here first so no other process can take the port between choosing and listening.
    OSError when `host` is not this machine's or `port` is taken. It serves while the store object lives: a
    rendezvous store of one attempt, or the control store of a job across nodes."""
    import torch.distributed as td

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        if port:  # a port named in advance (a run across nodes): free again at once after the last run on it
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(128)
        port = listener.getsockname()[1]
        store = td.TCPStore(host, port, None, True, datetime.timedelta(seconds=60),
                            wait_for_workers=False, master_listen_fd=os.dup(listener.fileno()))  # fmt: skip
    return store, port


@contextlib.contextmanager
def hosted_store(host: str = "127.0.0.1", preferred_port: int | None = None) -> Iterator[int]:
    """A rendezvous store on a loopback port (nothing reachable from other hosts; a run across nodes passes node 0's
    address as `host`) for as long as the block runs; yields its port. `preferred_port` (levers9 run
    --master-port) is used when it is free; else a free port is, and a warning says so."""
    store, port = None, 0
    if preferred_port:
        try:
            store, port = serve_store(host, preferred_port)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
    if store is None:
        store, port = serve_store(host)
        if preferred_port:
            log.warning("--master-port %d is in use on %s; the ranks get MASTER_PORT=%d, a free port, instead",
                        preferred_port, host, port)  # fmt: skip
    try:
        yield port
    finally:
        del store
