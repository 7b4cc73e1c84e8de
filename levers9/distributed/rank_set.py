"""One node's share of a run's ranks: started with their variables, their output handed on in pieces, watched by
the one Supervisor, ended as Outcomes.

`distributed.run` on one node (started_ranks.py), node 0 of a run across nodes and every node's agent (nodes.py)
start their ranks here: `rank_vars` is the one set of variables a rank gets, `RankOutput` the one rule for writing
ranks' output to the caller's streams.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from levers9.distributed import detect, group
from levers9.distributed.rank_process import RankSpec, RankTarget
from levers9.procs import echo, start
from levers9.procs.echo import LabelledOutput
from levers9.procs.failure import ship
from levers9.procs.supervise import DRAIN_S, Supervisor, Watched
from levers9.procs.watch import Child, Watcher
from levers9.runtime import JobContext

PieceSink = Callable[[int, str, str], None]  # (global rank, "stdout" or "stderr", a line with its "\n" or a piece)


# The start of the keys of every group levers9 makes on a store this process hosts (group.STORE_SECRET_VAR):
# known only to this user's processes, as their environment is.
_STORE_SECRET = secrets.token_hex(16)


def rank_vars(rank: int, world: int, port: int, *, addr: str = "127.0.0.1", run_id: str | None = None,
              shares: Sequence[int] | None = None, node: int = 0, secret: str | None = None) -> dict[str, str]:  # fmt: skip
    """The variables global `rank` of `world` gets: those torchrun's agent gives a worker, plus levers9's own.

    One node (`shares` None): the store on loopback `port` (LEVERS9_STORE_PORT). Node `node` of len(shares) (each
    node's rank count): no LEVERS9_STORE_PORT (that one means a loopback store). TORCHELASTIC_USE_AGENT_STORE=True
    makes torch's env:// rendezvous join the parent's store as a client on every rank (rank 0 included), as under
    torchrun; TORCHELASTIC_RUN_ID makes torch.distributed.is_torchelastic_launched() True. The keys of the group
    levers9 makes start with `secret` (default: this process's own).
    """
    counts = (world,) if shares is None else tuple(shares)
    r, w = str(rank), str(world)
    env = {
        "RANK": r, "LOCAL_RANK": str(rank - sum(counts[:node])), "ROLE_RANK": r, "WORLD_SIZE": w,
        "LOCAL_WORLD_SIZE": str(counts[node]), "ROLE_WORLD_SIZE": w, "GROUP_RANK": str(node), "NODE_RANK": str(node),
        "GROUP_WORLD_SIZE": str(len(counts)), "ROLE_NAME": "default", "MASTER_ADDR": addr, "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id or f"{detect.LEVERS9_RUN_ID_PREFIX}{os.getpid()}-{port}",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "LEVERS9_LAUNCHER": "levers9",
    }  # fmt: skip
    secret = _STORE_SECRET if secret is None else secret
    if secret:
        env[group.STORE_SECRET_VAR] = secret
    if shares is None:
        env[group.STORE_PORT_VAR] = str(port)
    return env


class RankOutput:
    """Ranks' output pieces to the caller's streams, "[rank N] " at the start of each line of a rank but 0."""

    def __init__(self, prefix: bool, write: Callable[[str, str], None] = echo.write) -> None:
        self.prefix = prefix
        self.labelled = LabelledOutput(write)

    def __call__(self, rank: int, stream: str, text: str) -> None:
        self.labelled(rank, f"[rank {rank}] " if self.prefix and rank != 0 else "", stream, text)


@dataclasses.dataclass(frozen=True)
class Share:
    """What every rank of this node's share of one attempt is started with."""

    first: int  # its first global rank
    count: int
    world: int
    backend: str
    call: Callable[..., Any] | bytes  # fn bound to cfg, or shipped for fresh interpreters
    method: start.StartMethod
    env_of: Callable[[int], dict[str, str]]  # global rank -> its variables on top of the caller's
    board: str | None  # the board folder (timeout= or stall_timeout= asked)
    job: JobContext | None
    make_group: bool = True
    pass_rank: bool = False
    stdin_rank0: bool = False  # rank 0 reads the caller's stdin
    board_slots: bool = False  # each rank's board slot is its local rank (across nodes)


class RankSet:
    """This node's ranks of one attempt, on one Watcher; their output goes to `sink` in pieces (never a line held
    whole), each with its global rank. Where the caller's streams are terminals (`terminal`) ranks see one too, and
    what each read brings is handed on at once, as written."""

    def __init__(self, sink: PieceSink, *, terminal: bool = False) -> None:
        self.sink = sink
        self.stdio = start.Stdio.like_caller(stdin=False) if terminal else start.Stdio()
        self.watcher = Watcher(on_text=self._piece, immediate=self.stdio != start.Stdio(), exact=True)
        self.children: list[Child] = []
        self._rank_of: dict[int, int] = {}  # pid -> global rank

    def _piece(self, child: Child, stream: str, text: str) -> None:
        self.sink(self._rank_of[child.pid], stream, text)

    def start(self, share: Share) -> list[Child]:
        """Start every rank of `share`, in order; their Children (watched here)."""
        for local in range(share.count):
            rank = share.first + local
            spec = RankSpec(rank, share.world, share.backend, share.board, share.job, make_group=share.make_group,
                            pass_rank=share.pass_rank, board_slot=local if share.board_slots else None)  # fmt: skip
            target = RankTarget(spec, share.call)
            stdio = dataclasses.replace(self.stdio, stdin=rank == 0 and share.stdin_rank0)
            child = start.start(target, method=share.method, shipped=None if share.method.forks else ship(target),
                                env=share.env_of(rank), name=f"rank {rank}", stdio=stdio)  # fmt: skip
            self._rank_of[child.pid] = rank
            self.children.append(self.watcher.add(child))
        return self.children

    def supervisor(self, *others: Watched, **rules: Any) -> Supervisor:
        """The one Supervisor of these ranks (first, in order) and `others` (another node's share), stopping them
        all once one failed; `rules` are Supervisor's keywords (timeout, grace, stalled, ...)."""
        return Supervisor(self.watcher, [*self.children, *others], stop_on_failure=True, **rules)

    def stop(self, grace: float) -> None:
        """Stop what still runs (an interrupt or an error left it), then hand on what the ranks wrote before they
        ended: a line still in a pipe when Ctrl-C came is shown, not lost."""
        self.watcher.stop(grace)
        self.watcher.drain(DRAIN_S)

    def close(self) -> None:
        self.watcher.close()
