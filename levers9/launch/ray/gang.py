"""A job larger than any Ray node: one placement group, one bundle per node, levers9's agent on each node but the first.

Planned (`plan_gang`) only when no single node could ever hold the job: the fewest nodes k such that
gpu_count splits into k equal shares and k nodes could each hold one share of the job's card type; an
uneven or impossible split is refused before anything starts, with a table of the nodes. The job's Ray
task runs in bundle 0 of a STRICT_SPREAD placement group (`reserve`), hosts the job's control store
(`host`) and starts an agent (`_agent`: distributed.node_agent.serve) in every other bundle;
`distributed.run` inside the job does the rest (nodes.py). A lost node's agent is started again in its
bundle, which Ray places on another node once it knows the first is dead (`GangHost`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import ray
from ray.util import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from levers9.distributed.control_store import ControlStore, serve_store
from levers9.errors import InfeasibleJobError
from levers9.launch import job_process
from levers9.launch.job_process import TaskPayload, remove_scratch_dir, scratch_dir
from levers9.launch.ray.resources import RESOURCE_PREFIX, resource_name
from levers9.launch.spec import JobSpec
from levers9.runtime import GangContext, describe_split

PG_POLL_S = 0.2  # how often a waiting placement group is checked against the deadline and cancellation
AGENT_EXIT_WAIT_S = 5.0  # after the job, how long the agents get to stop their ranks before they are cancelled
REPLACE_WAIT_S = 120.0  # how long a restart waits for a node to replace a lost one when the job has no queue_timeout


@dataclasses.dataclass(frozen=True)
class Node:
    """An alive Ray node as the feasibility check sees it."""

    address: str
    resources: dict[str, float]

    @property
    def gpus(self) -> int:
        return int(self.resources.get("GPU", 0))

    def describe(self) -> str:
        """'192.0.2.2 with 4× RTXPro6000' (types from its levers9_ resources)."""
        prefixed = {k: v for k, v in self.resources.items() if k.startswith(RESOURCE_PREFIX)}
        types = {k.removeprefix(RESOURCE_PREFIX): int(v) for k, v in prefixed.items()}
        if types:
            cards = ", ".join(f"{n}× {t}" for t, n in sorted(types.items()))
        else:
            cards = f"{self.gpus} GPU(s) with no levers9_<type> resource"
        return f"{self.address} with {cards}, {self.resources.get('CPU', 0):g} CPU(s)"


@dataclasses.dataclass(frozen=True)
class GangPlan:
    """A job split over `nodes` nodes of `share` cards of `gpu_type` each."""

    gpu_type: str
    nodes: int
    share: int
    candidates: tuple[str, ...]  # the addresses of the nodes that could hold a share, for messages

    def describe(self, addresses: tuple[str, ...] | None = None) -> str:
        """'4 x RTXPro6000 as 2 nodes x 2: 127.0.0.2, 127.0.0.3'."""
        where = addresses or self.candidates[: self.nodes]
        return describe_split(self.nodes * self.share, (self.share,) * self.nodes, where, self.gpu_type or "GPU")


def split(gpu_count: int, capacities: list[int]) -> tuple[int, int] | None:
    """(k, share): the fewest nodes k >= 2 with gpu_count % k == 0 and k nodes holding gpu_count / k each; None if none."""
    for k in range(2, min(gpu_count, len(capacities)) + 1):
        if gpu_count % k == 0 and sum(1 for c in capacities if c >= gpu_count // k) >= k:
            return k, gpu_count // k
    return None


def _cards_of_type(resources: Mapping[str, float], gpu_type: str) -> int:
    gpus = int(resources.get("GPU", 0))
    return min(gpus, int(resources.get(resource_name(gpu_type), 0))) if gpu_type else gpus


def plan_gang(spec: JobSpec, nodes: list[Node], single: InfeasibleJobError, free: dict[str, dict[str, float]] | None = None) -> GangPlan:
    """The split for a job no single node could hold (`single` says why); InfeasibleJobError with a table of the
    nodes when no even split exists."""
    n = spec.gpu_count
    for gpu_type in spec.gpu_types or ("",):
        capacities = [_cards_of_type(nd.resources, gpu_type) for nd in nodes]
        found = split(n, capacities) if n > 1 else None
        if found is not None:
            k, share = found
            holders = tuple(nd.address for nd, c in zip(nodes, capacities, strict=True) if c >= share)
            return GangPlan(gpu_type, k, share, holders)
    raise InfeasibleJobError(
        f"{single}\nNor can it be split evenly across nodes: {spec.describe_cards()} needs k nodes holding "
        f"gpu_count/k cards each (k dividing {n}), and these are the alive nodes:\n{node_table(nodes, spec.gpu_types, free)}\n"
        f"Ask for a gpu_count that is a multiple of what nodes hold (e.g. gpu_count={_suggest(spec, nodes)}), or add nodes."
    ) from None


def _suggest(spec: JobSpec, nodes: list[Node]) -> str:
    """'2 or gpu_count=4': the nearest card counts below and above the asked one that one node or an even split holds."""
    caps = [_cards_of_type(nd.resources, spec.gpu_types[0] if spec.gpu_types else "") for nd in nodes]

    def holds(m: int) -> bool:
        return max(caps, default=0) >= m or split(m, caps) is not None

    below = next((m for m in range(spec.gpu_count - 1, 0, -1) if holds(m)), None)
    above = next((m for m in range(spec.gpu_count + 1, sum(caps) + 1) if holds(m)), None)
    return " or gpu_count=".join(str(m) for m in (below, above) if m is not None) or "1"


def node_table(nodes: list[Node], gpu_types: tuple[str, ...], free: dict[str, dict[str, float]] | None) -> str:
    """One line per alive node: its address, cards of each asked-for type (total and free now), CPUs."""
    types = gpu_types or ("",)
    header = "  node             " + "  ".join(f"{t or 'GPU':>16}" for t in types) + "    CPU"
    lines = [header]
    for nd in nodes:
        avail = (free or {}).get(nd.address, {})
        cells = []
        for t in types:
            total, now = _cards_of_type(nd.resources, t), _cards_of_type(avail, t)
            cells.append(f"{total:>4} ({now} free)".rjust(16) if free is not None else f"{total:>16}")
        lines.append(f"  {nd.address:<16} " + "  ".join(cells) + f"  {nd.resources.get('CPU', 0):5g}")
    if not nodes:
        lines.append("  (no alive node)")
    return "\n".join(lines)


def free_by_node() -> dict[str, dict[str, float]] | None:
    """What each alive node has free now, by address (None if Ray does not say)."""
    try:
        per_id = ray._private.state.available_resources_per_node()
        return {str(n["NodeManagerAddress"]): dict(per_id.get(n["NodeID"], {})) for n in ray.nodes() if n.get("Alive")}
    except Exception:
        return None


def reserve(bundles: list[dict[str, float]], deadline: float | None, stopped: Callable[[], bool]) -> Any:
    """A ready STRICT_SPREAD placement group of `bundles` (one per node: its share of the job's resources), or
    None if `stopped()` or the deadline came first (then nothing is left reserved)."""
    pg = placement_group(bundles, strategy="STRICT_SPREAD")
    ready = pg.ready()
    while True:
        done, _ = ray.wait([ready], timeout=PG_POLL_S)
        if done:
            return pg
        if stopped() or (deadline is not None and time.monotonic() >= deadline):
            release(pg)
            return None


def release(pg: Any) -> None:
    with contextlib.suppress(Exception):
        remove_placement_group(pg)


def in_bundle(pg: Any, index: int) -> dict[str, Any]:
    """Task options that place a task in bundle `index` of `pg`."""
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)}


def bundle_addresses(pg: Any) -> tuple[str, ...]:
    """The address of the node each bundle of a ready placement group is on, bundle 0 first."""
    table = placement_group_table(pg)
    by_id = {n["NodeID"]: str(n["NodeManagerAddress"]) for n in ray.nodes()}
    placed = table["bundles_to_node_id"]
    return tuple(by_id.get(placed[i], "?") for i in sorted(placed))


# ---- inside node 0's Ray task -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AgentPayload:
    """What an agent's Ray task on node `gang.node_index` gets: its job's task payload (no placement group), the
    gang as that node sees it, and which agent of that node it is."""

    task: TaskPayload
    gang: GangContext
    generation: int  # one more per replacement of the node's agent; an older one exits
    first_attempt: int  # the attempt it starts at (a replacement joins a restart)


@contextlib.contextmanager
def host(payload: TaskPayload, address: str, stop_grace: float) -> Iterator[GangHost]:
    """Host the job's control store on this node's address and start the agents of nodes 1..k-1; yields what the
    task's loop needs: the GangContext the job process gets, and `poll()`, which replaces a lost node's agent
    when the job process asks. At the end the agents are told the job is over, then cancelled."""
    gang = payload.gang
    assert gang is not None, "host() is for a job across nodes"
    spec = payload.spec
    k = gang.nodes
    server, port = serve_store(address)
    secret = secrets.token_hex(16)
    store = ControlStore.under_secret(server, secret)
    placed = bundle_addresses(gang.pg)
    within = REPLACE_WAIT_S if spec.queue_timeout is None else spec.queue_timeout
    context = GangContext(address, port, (address, *placed[1:]), (gang.share,) * k, 0, within, secret)
    agents = GangHost(payload, context, store)
    try:
        for i in range(1, k):
            agents.launch(i, first_attempt=0)
        yield agents
    finally:
        with contextlib.suppress(Exception):
            store.end()
        agents.wait_then_cancel(stop_grace + AGENT_EXIT_WAIT_S)
        del agents, store, server


class GangHost:
    """Node 0's Ray task's side of a job across nodes: the agent tasks of nodes 1..k-1, one per bundle, each
    launched again when the job process asks for a replacement of a lost node (control_store.py). No thread:
    the task's loop calls `poll`."""

    def __init__(self, payload: TaskPayload, context: GangContext, store: ControlStore) -> None:
        assert payload.gang is not None
        self.payload, self.gang, self.context, self.store = payload, payload.gang, context, store  # store: hosted here
        self.refs: dict[int, Any] = {}  # node -> its current agent task
        self.pending: dict[int, tuple[int, float]] = {}  # node being replaced -> (attempt it starts at, deadline)
        self.next_poll = 0.0

    def launch(self, node: int, first_attempt: int) -> None:
        """A new agent for `node` in its bundle, one generation newer than any before it (an older one exits)."""
        gang = self.gang
        share = gang.share
        generation = self.store.new_generation(node)
        opts = {"num_gpus": share, "num_cpus": 0, "max_retries": 0, "retry_exceptions": False, "name": "levers9-agent",
                "resources": {resource_name(gang.gpu_type): float(share)} if gang.gpu_type else {},
                **in_bundle(gang.pg, node)}  # fmt: skip
        agent_payload = AgentPayload(dataclasses.replace(self.payload, gang=None),
                                     dataclasses.replace(self.context, node_index=node), generation, first_attempt)
        self.refs[node] = _agent_task.options(**opts).remote(agent_payload)

    def poll(self) -> None:
        """Answer each ask for a replacement (at most every PG_POLL_S): cancel the lost agent and launch one in
        its bundle, again if that one ends before it joins (Ray re-places a dead node's bundle once it knows);
        post the refusal when none joined within replace_within s, or at once when Ray refused the launch."""
        now = time.monotonic()
        if now < self.next_poll:
            return
        self.next_poll = now + PG_POLL_S
        try:
            self._poll(now)
        except Exception as exc:  # the job process then fails naming the lost node and this error
            for i in list(self.pending):
                with contextlib.suppress(Exception):
                    self.store.refuse_replacement(i, f"starting its agent failed: {type(exc).__name__}: {exc}")
                del self.pending[i]

    def _poll(self, now: float) -> None:
        for i in range(1, len(self.context.shares)):
            if i not in self.pending and (first_attempt := self.store.take_replacement(i)) is not None:
                with contextlib.suppress(Exception):
                    ray.cancel(self.refs[i], force=True)
                self.pending[i] = (first_attempt, now + self.context.replace_within)
                self.launch(i, first_attempt)
        for i, (first_attempt, deadline) in list(self.pending.items()):
            if self.store.joined(i) is not None:
                del self.pending[i]
            elif now >= deadline:
                with contextlib.suppress(Exception):
                    ray.cancel(self.refs[i], force=True)
                self.store.refuse_replacement(i, "Ray placed no agent of levers9 on an alive node with the cards free")
                del self.pending[i]
            elif ray.wait([self.refs[i]], timeout=0)[0]:  # it ended before joining: its node died too
                self.launch(i, first_attempt)

    def wait_then_cancel(self, within: float) -> None:
        """Give the agents that are not declared lost `within` s to end, then cancel every one."""
        waiting = [ref for i, ref in self.refs.items() if not _declared_lost(self.store, i)]
        if waiting:
            with contextlib.suppress(Exception):
                ray.wait(waiting, num_returns=len(waiting), timeout=within)
        for ref in self.refs.values():
            with contextlib.suppress(Exception):
                ray.cancel(ref, force=True)


def _declared_lost(store: ControlStore, node: int) -> bool:
    try:
        return store.is_lost(node)
    except Exception:
        return True


# ---- inside the agent's Ray task on node i ----------------------------------------------------------------


def _agent(payload: AgentPayload) -> None:
    """Node i's agent: this bundle's cards, a scratch folder, then node_agent.serve until the job ends."""
    from levers9.distributed import node_agent

    task, gang = payload.task, payload.gang
    task.use_sys_path()
    spec = task.spec
    ids = [str(i) for i in ray.get_gpu_ids()]
    index, attempt = task.index, task.attempt
    job_dir = scratch_dir("ray", index, attempt)
    try:
        env = job_process.job_env(spec, [])
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
        context = job_process.task_context(spec, task.run_id, index, attempt, str(job_dir), ids, task.gpu_type, gang)
        env.update(job_process.quirk_env(context, env))  # this node's cards' quirks, for the ranks it starts
        node_agent.serve(gang, ray.util.get_node_ip_address(), context, env, generation=payload.generation,
                    first_attempt=payload.first_attempt)  # fmt: skip
    finally:
        remove_scratch_dir(job_dir)


_agent_task = ray.remote(_agent)
