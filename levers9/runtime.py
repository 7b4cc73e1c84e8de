"""What levers9 knows about this process, as one typed value, built where a rank or a job process starts.

A job process begins with its JobContext (launch/job_process.py); a rank of `distributed.run` with its job's
context, the mark that its parent applied the quirks for it, and whether it computes on the CPU
(distributed/rank_process.py); any other process has the empty value. The value is kept process-wide, once,
because what reads it is process-wide by nature: torch's default process group (which levers9 may have made,
and then alone destroys), the environment the quirks set, and the helpers and `levers9.current_job()` that
user code calls with no argument.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from levers9.distributed.hardware.quirk_rows import QuirkPlan


@dataclasses.dataclass
class Runtime:
    """This process, in levers9's eyes."""

    job: JobContext | None = None  # the job this process runs (a job process, and the ranks it started)
    quirks: QuirkPlan | None = None  # the plan applied in this process (a job process, in place, under a launcher)
    # a rank distributed.run started: its parent planned the quirks for all its ranks and handed their variables
    # down in this rank's environment, so the rank plans none of its own
    quirks_from_parent: bool = False
    cpu_only: bool = False  # a rank of a gloo run: it computes on the CPU even where CUDA is present
    own_group: bool = False  # levers9 made the default process group (it destroys no other)
    groups_made: int = 0  # groups levers9 made on a launcher's store here: each gets store keys of its own


_this_process = Runtime()


def this_process() -> Runtime:
    """This process's Runtime (the empty one unless a rank or job began here)."""
    return _this_process


def begin(runtime: Runtime) -> None:
    """Make `runtime` this process's: the child side of a rank or job calls this before the user's function
    (a forked child must not keep what its parent knew about itself)."""
    global _this_process
    _this_process = runtime


def current_job() -> JobContext | None:
    """The job this process runs (in a job process and in the ranks it started), else None."""
    return _this_process.job


@dataclasses.dataclass(frozen=True)
class GangContext:
    """A job that holds cards on several Ray nodes (issue 25), or `levers9 run` across nodes (srun's one task per
    node, torchrun's --nnodes): where its control store is, and each node's share.

    The job process runs on node 0; `distributed.run` there starts ranks 0..shares[0]-1 and asks the
    levers9 agent on each other node (through the control store node 0's Ray task hosts) to start its
    share. `node_index` is the node the holder of this value runs on."""

    control_addr: str
    control_port: int
    addresses: tuple[str, ...]  # the Ray node address of each node, node 0 first
    shares: tuple[int, ...]  # cards (ranks) on each node
    node_index: int = 0
    replace_within: float = 120.0  # seconds a restart waits for a node to replace a lost one (the job's queue_timeout)
    # Starts every key of the control store and of the ranks' group: the stores listen on the cluster
    # network, and only the job's own processes, handed this value by Ray, can name (so set) a key they read.
    secret: str = ""
    join_within: float = 120.0  # seconds node 0 waits for every other node's agent to join (then names the missing)
    # What to look at when a node's agent never joined or went silent: how that node's agent is started.
    check_node: str = "check that node in `ray status` and its Ray logs (the agent is a Ray task named levers9-agent)"

    @property
    def world_size(self) -> int:
        return sum(self.shares)

    def first_rank(self, node: int) -> int:
        """The global rank of node `node`'s local rank 0."""
        return sum(self.shares[:node])

    def describe(self) -> str:
        """'4 as 2 nodes x 2: 127.0.0.2, 127.0.0.3'."""
        return describe_split(self.world_size, self.shares, self.addresses)


def describe_split(total: int, shares: tuple[int, ...], addresses: tuple[str, ...], gpu_type: str = "") -> str:
    """'4 x RTXPro6000 as 2 nodes x 2: <ip>, <ip>' ('4 as ...' without a type), as the status line shows a plan."""
    cards = f"{total} x {gpu_type}" if gpu_type else str(total)
    return f"{cards} as {len(shares)} nodes x {shares[0]}: {', '.join(addresses)}"


@dataclasses.dataclass(frozen=True)
class JobContext:
    """One attempt of one cell: where it belongs, its cards, and the limits `distributed.run` inherits.

    The job layer hands it to the job process inside the job's target (pickled for a fresh interpreter), never
    through environment variables. `distributed.run` inside the job reads it: the job's cards (simulated or
    real) decide how many ranks start and on which backend, and its stall_timeout and max_restarts are the
    run's defaults; the ranks carry it on."""

    run_id: str
    cell_index: int
    attempt: int
    job_dir: str
    gpu_count: int = 0
    gpu_type: str = ""
    simulated: bool = False  # the cards are LEVERS9_SIMULATE_GPUS's: ranks compute on the CPU with gloo
    stall_timeout: float | None = None
    max_restarts: int = 0
    gang: GangContext | None = None  # set when the job holds cards on several Ray nodes

    @property
    def job_id(self) -> str:
        """'<run id>/<cell index>', as `levers9 runs` names a cell."""
        return f"{self.run_id}/{self.cell_index}"
