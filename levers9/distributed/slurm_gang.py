"""srun with one task per node, as levers9's launcher on each node: node 0 hosts, the other nodes serve.

    srun -N2 --ntasks-per-node=1 levers9 run --nproc-per-node 2 train.py      # 2 nodes x 2 ranks

(The SLURM backend does not use it: there srun is the launcher of every rank, one task per card.)

Each task is a launcher, not a rank. The first node's task hosts the control store (control_store.py) at the
step's port (MASTER_PORT, else slurm_env.master_port) and runs `distributed.run` with a GangContext (nodes.py);
the task on node i serves node i's share (node_agent.py), as Ray's agents do. SLURM keeps no spare node, so a lost
node is not replaced. The store listens on the network and unpickles what it reads, so its keys start with
LEVERS9_GANG_SECRET, which the job script exports before srun: SLURM hands the tasks no secret of their own
(anything derived from the job's ids and the uid, another user who reads squeue derives too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from levers9 import runtime
from levers9.distributed import slurm_env
from levers9.distributed.control_store import ControlStore
from levers9.distributed.detect import expand_nodelist
from levers9.distributed.group import check_resolves
from levers9.distributed.nodes import HEARTBEAT_EVERY_S
from levers9.errors import LauncherEnvError, NodeLost, RankFailed
from levers9.runtime import GangContext, JobContext

T = TypeVar("T")
LEAVE_QUIET_S = 3 * HEARTBEAT_EVERY_S  # no heartbeat for this long: the agents left
LEAVE_WAIT_S = 10.0
SECRET_VAR = "LEVERS9_GANG_SECRET"
MIN_SECRET_CHARS = 16


def _count(env: Mapping[str, str], *names: str) -> int:
    for name in names:
        if env.get(name, "").isdigit():
            return int(env[name])
    return 1


def check_one_task_per_node(env: Mapping[str, str], what: str) -> bool:
    """True when this process is a task of an srun step of one task on each of several nodes (a launcher per
    node); False outside a step or on one node (where levers9 run refuses to start inside a rank). LauncherEnvError
    for several tasks on a node of several, where each would start the node's ranks again."""
    if "SLURM_PROCID" not in env or slurm_env.step_id(env) is None:
        return False
    nodes = _count(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES")
    tasks = _count(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if nodes == 1:
        return False
    if tasks != nodes:
        raise LauncherEnvError(
            f"{what} ran as one of {tasks} srun task(s) on {nodes} node(s) (SLURM_STEP_NUM_TASKS={tasks}, "
            f"SLURM_STEP_NUM_NODES={nodes}), so some node runs it more than once and would start its ranks twice. "
            f"Expected one task per node, each starting that node's ranks: `srun --ntasks-per-node=1 {what} ...` "
            f"(in a job script, `#SBATCH --ntasks-per-node=1`)."
        )
    return True


def not_a_rank() -> None:
    """This task launches ranks; it is not one: the variables that make detect.py call it a rank go."""
    for name in ("SLURM_PROCID", "SLURM_LOCALID"):
        os.environ.pop(name, None)


def gang_of_step(env: Mapping[str, str], per_node: int) -> GangContext:
    """The GangContext of this step (one task per node, `per_node` ranks on each): its nodes' addresses,
    node 0's control store address and port, this task's node index, the step's secret."""
    variable = "SLURM_STEP_NODELIST" if env.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
    names = expand_nodelist(env.get(variable, ""), variable)
    secret = gang_secret(env, f"levers9 run across {len(names)} nodes under srun", "SLURM gives the tasks no secret "
                         "of their own", "Add to the job script, before srun")  # fmt: skip
    addresses = []
    for name in names:
        check_resolves(name, variable)
        addresses.append(socket.gethostbyname(name))
    node = _count(env, "SLURM_NODEID")
    port = env.get("MASTER_PORT", "")
    control_port = int(port) if port.isdigit() else slurm_env.master_port(env) or 29500
    return GangContext(addresses[0], control_port, tuple(addresses), (per_node,) * len(names), node, 0.0, secret,
                       check_node="check that node's srun task (its output, `sacct -j <job>`)")  # fmt: skip


def gang_secret(env: Mapping[str, str], what: str, why_needed: str, where: str) -> str:
    """LEVERS9_GANG_SECRET; LauncherEnvError naming the run (`what`), why its launcher has no secret of its own and
    the line to add `where`, when it is unset or short."""
    secret = env.get(SECRET_VAR, "")
    if len(secret) < MIN_SECRET_CHARS:
        seen = "it is unset" if SECRET_VAR not in env else f"it has {len(secret)} character(s)"
        raise LauncherEnvError(
            f"{what} needs {SECRET_VAR}, a secret only this job's launchers know ({seen}; expected at least "
            f"{MIN_SECRET_CHARS} characters): the store between the nodes listens on the network and unpickles what "
            f"it reads, and {why_needed}. {where}: export {SECRET_VAR}=$(python -c 'import secrets; "
            f"print(secrets.token_hex(16))')"
        )
    return secret


def _listen_for_step(gang: GangContext) -> Any:
    """A TCPStore server for the step's control store on the gang's address and port (node 0)."""
    import torch.distributed as td

    try:
        return td.TCPStore(gang.control_addr, gang.control_port, None, True, datetime.timedelta(seconds=60),
                           wait_for_workers=False)  # fmt: skip
    except (RuntimeError, OSError) as exc:
        raise LauncherEnvError(
            f"node 0 could not listen on {gang.control_addr}:{gang.control_port} for the levers9 store of this srun "
            f"step ({type(exc).__name__}: {exc}). Expected that port free on the first node: export MASTER_PORT="
            f"<a free port> in the job script before srun (every node's task reads it)."
        ) from exc


@contextlib.contextmanager
def _hosted_control(gang: GangContext, server: Any) -> Iterator[None]:
    """The job's control store, served by this process (node 0) through `server`; at the end, the agents are told
    whether the run failed and given time to leave."""
    store = ControlStore.under_secret(server, gang.secret)
    failed = False
    try:
        yield
    except BaseException:
        failed = True
        raise
    finally:
        with contextlib.suppress(Exception):
            store.end(failed)
            _wait_for_agents_to_leave(store, len(gang.shares))
        del store, server


def _wait_for_agents_to_leave(store: ControlStore, nodes: int) -> None:
    """After `end`: return once no agent's heartbeat moved for LEAVE_QUIET_S (each saw the end and stopped),
    or after LEAVE_WAIT_S; an agent whose store went away first would fail instead of ending."""
    deadline = time.monotonic() + LEAVE_WAIT_S
    beats = [store.beats(i) for i in range(1, nodes)]
    quiet_since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = [store.beats(i) for i in range(1, nodes)]
        if now != beats:
            beats, quiet_since = now, time.monotonic()
        elif time.monotonic() - quiet_since > LEAVE_QUIET_S:
            return


def launcher_job(gang: GangContext, env: Mapping[str, str] = os.environ, run_id: str | None = None) -> JobContext:
    """The JobContext a launcher (`levers9 run` under srun, or with --nnodes) runs its node under: SLURM job <id>'s
    step unless `run_id` names the run, with the node's CUDA_VISIBLE_DEVICES cards."""
    cards = [c for c in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if c.strip()]
    job_id = run_id or f"slurm-{env.get('SLURM_JOB_ID', '?')}.{env.get('SLURM_STEP_ID', '?')}"
    return JobContext(run_id=job_id, cell_index=0, attempt=1, job_dir="", gpu_count=len(cards), gang=gang)


def run_as_node(gang: GangContext, job: JobContext, base_env: dict[str, str], node_zero: Callable[[], T],
                server: Any = None) -> T | None:  # fmt: skip
    """This launcher's part of the run: on node 0, `node_zero()` (which calls distributed.run) under `job` with the
    gang, the control store hosted here (through `server` when the caller already listens, else on the gang's
    address and port); on node i, serve node i's share until node 0 ends the run (None), or raise when node 0's run
    failed (RankFailed: node 0 printed the root failure) or node 0 went away first (NodeLost)."""
    from levers9.distributed import node_agent

    not_a_rank()
    job = dataclasses.replace(job, gang=gang)
    if gang.node_index == 0:
        runtime.begin(runtime.Runtime(job=job))
        with _hosted_control(gang, _listen_for_step(gang) if server is None else server):
            return node_zero()
    # generation 0: node 0 never launches a replacement (no spare node), so no generation is ever counted
    end = node_agent.serve(gang, gang.addresses[gang.node_index], job, base_env, generation=0)
    zero = f"node 0 ({gang.addresses[0]})"
    if end == "failed":
        raise RankFailed(
            f"levers9 run: the run across {len(gang.shares)} nodes failed; {zero} printed the failing rank and its "
            f"traceback, and every rank on every node was stopped. Expected every rank to succeed; see {zero}'s output."
        )
    if end == "lost":
        raise NodeLost(
            f"levers9 run: lost {zero}, whose launcher hosts the run's store at {gang.control_addr}:{gang.control_port}, "
            f"before the run ended; every rank on node {gang.node_index} was stopped. Expected node 0's launcher to run "
            f"until the end; see its output (and its kernel log for the OOM killer).",
            gang.addresses[0], tuple(range(gang.shares[0])),
        )  # fmt: skip
    return None
