"""`levers9 run` across machines as torchrun does it: `--nnodes N` with a static or a c10d rendezvous.

    levers9 run --nnodes 2 --node-rank 0|1 --master-addr HOST --master-port P --nproc-per-node 2 train.py
    levers9 run --nnodes 2 --rdzv-backend c10d --rdzv-endpoint HOST:P --rdzv-id ID --nproc-per-node 2 train.py

(Kubeflow's PyTorchJob sets the same options as PET_NNODES, PET_NODE_RANK, ...: levers9/cli/run.py.)
Only where the node layout comes from differs from srun's one task per node (slurm_gang.py), which runs the rest.

- static: each launcher is node --node-rank; node 0 listens on --master-addr:--master-port.
- c10d: the launcher that can listen on the endpoint (or the one `--rdzv-conf is_host=1` names) is node 0; the
  others number themselves 1, 2, ... in the order they join.
- levers9 does not resize a running job: `--nnodes MIN:MAX` waits for MAX nodes and runs on exactly that many.
- Node 0 names every node that did not join within `--rdzv-conf join_timeout=` (torchrun's default, 600 s); a
  node whose node 0 never listened says so within the same time.
- LEVERS9_GANG_SECRET is needed with a loopback master too: every user of the machine can reach a loopback port.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import logging
import os
import socket
import time
from collections.abc import Mapping
from typing import Any

from levers9.distributed import slurm_gang
from levers9.distributed.control_store import ControlStore, serve_store
from levers9.distributed.group import check_resolves
from levers9.errors import ConfigError, LauncherEnvError, NodeLost
from levers9.runtime import GangContext, JobContext

log = logging.getLogger("levers9.run")

DEFAULT_MASTER_PORT = 29500  # torchrun's --master-port
DEFAULT_C10D_PORT = 29400  # torchrun's port for an --rdzv-endpoint that names none
DEFAULT_JOIN_TIMEOUT_S = 600.0  # torchrun's rendezvous join_timeout
DEFAULT_RDZV_ID = "none"  # torchrun's --rdzv-id
NOT_JOINED = "not joined"  # the address of a node before its agent joined
KUBERNETES = "docs/from-torchrun.md#kubernetes-kubeflow"


@dataclasses.dataclass(frozen=True)
class NodeLayout:
    """What one `levers9 run --nnodes` launcher was told: how many nodes, which one it is (c10d: numbered as they
    join), where node 0 hosts the run's store, how long the nodes wait for each other."""

    nodes: int
    node_rank: int | None  # None: the c10d rendezvous numbers the nodes as they join
    host: str
    port: int
    run_id: str
    join_timeout: float
    is_host: bool | None = None  # c10d: --rdzv-conf is_host= (None: whichever launcher can listen on the endpoint)

    def command(self, node: str = "<i>") -> str:
        """torchrun's options that start node `node` of this run."""
        if self.node_rank is None:
            return (f"levers9 run --nnodes {self.nodes} --rdzv-backend c10d --rdzv-endpoint {self.host}:{self.port} "
                    f"--rdzv-id {self.run_id}")  # fmt: skip
        return f"levers9 run --nnodes {self.nodes} --node-rank {node} --master-addr {self.host} --master-port {self.port}"


@dataclasses.dataclass(frozen=True)
class NodePlace:
    """This launcher's node of the run: the gang every node shares, the job its ranks run under, and on node 0 the
    control store's server (already listening)."""

    gang: GangContext
    job: JobContext
    server: Any = None


def layout_of(options: Any) -> NodeLayout | None:
    """The node layout torchrun's options ask for (`nnodes`, `node_rank`, `master_addr`, `master_port`,
    `rdzv_backend`, `rdzv_endpoint`, `rdzv_id`, `rdzv_conf`, `standalone`, as `levers9 run` parsed them); None for
    one node; ConfigError for what torchrun would refuse or levers9 cannot do."""
    low, high = _node_range(str(options.nnodes))
    if high == 1:
        return None
    if options.standalone:
        raise ConfigError(f"--standalone with --nnodes {options.nnodes}; expected one or the other: --standalone runs "
                          f"on this machine alone. Drop --standalone to run across {high} nodes.")  # fmt: skip
    if low != high:
        log.warning("levers9 run: --nnodes %s: levers9 does not resize a running job, so it waits for all %d nodes "
                    "and runs on exactly %d (pass --nnodes %d to say so)", options.nnodes, high, high, high)  # fmt: skip
    conf = _rdzv_conf(options.rdzv_conf or "")
    join_timeout = _seconds("join_timeout", conf.get("join_timeout", str(DEFAULT_JOIN_TIMEOUT_S)))
    run_id = options.rdzv_id or DEFAULT_RDZV_ID
    backend = options.rdzv_backend or "static"
    if backend == "static":
        node_rank = _whole("--node-rank", str(options.node_rank))
        if node_rank >= high:
            raise ConfigError(f"--node-rank {node_rank} with --nnodes {options.nnodes}; expected 0 to {high - 1}: "
                              f"number the nodes 0, 1, ... (node 0 hosts, at --master-addr).")  # fmt: skip
        if options.rdzv_endpoint:
            host, port = _endpoint(options.rdzv_endpoint, DEFAULT_MASTER_PORT)
        else:
            host = options.master_addr or "127.0.0.1"
            port = _port("--master-port", str(options.master_port or DEFAULT_MASTER_PORT))
        return NodeLayout(high, node_rank, host, port, run_id, join_timeout)
    if backend == "c10d":
        if not options.rdzv_endpoint:
            raise ConfigError(f"--rdzv-backend c10d with --nnodes {options.nnodes} but no --rdzv-endpoint; expected "
                              f"HOST:PORT of the node that hosts the rendezvous, e.g. --rdzv-endpoint node0:29400.")  # fmt: skip
        host, port = _endpoint(options.rdzv_endpoint, DEFAULT_C10D_PORT)
        is_host = None if "is_host" not in conf else _truth("is_host", conf["is_host"])
        return NodeLayout(high, None, host, port, run_id, join_timeout, is_host)
    raise ConfigError(f"--rdzv-backend {backend}; expected static (with --master-addr/--master-port) or c10d (with "
                      f"--rdzv-endpoint HOST:PORT): levers9 run has no {backend} rendezvous.")  # fmt: skip


def join(layout: NodeLayout, per_node: int, env: Mapping[str, str] = os.environ) -> NodePlace:
    """Meet the other nodes' launchers: node 0 listens and says what the run is; node i reaches node 0 within
    join_timeout, checks that both were started alike, and takes its number (c10d: the next one). LauncherEnvError
    for a missing secret or a mismatch, NodeLost when node 0 never listened."""
    secret = slurm_gang.gang_secret(env, f"levers9 run across {layout.nodes} nodes (--nnodes {layout.nodes})",
                                    "torchrun's options give the launchers no secret of their own",
                                    f"Set the same value on every node before levers9 run (in Kubernetes, from a "
                                    f"Secret in the pod's env: {KUBERNETES})")  # fmt: skip
    source = "--rdzv-endpoint" if layout.node_rank is None else "--master-addr"
    check_resolves(layout.host, source)
    address = socket.gethostbyname(layout.host)
    expected = (layout.run_id, per_node, layout.nodes)
    server = _listen(layout, address)
    if server is not None:
        ControlStore.under_secret(server, secret).open_rendezvous(expected)
        node, here = 0, address
    else:
        store = _reach_node_zero(layout, address, secret, expected)
        node = layout.node_rank if layout.node_rank is not None else store.next_node()
        if node >= layout.nodes:  # c10d: more launchers than nodes (static numbers are checked by layout_of)
            raise LauncherEnvError(
                f"this launcher joined {layout.host}:{layout.port} as node {node}, but the run has --nnodes "
                f"{layout.nodes} and every node joined already. Expected one launcher per node, {layout.nodes} in all: "
                f"stop this one, or start every launcher with --nnodes {node + 1}."
            )
        here = _address_towards(address, layout.port)
    addresses = tuple(address if i == 0 else here if i == node else NOT_JOINED for i in range(layout.nodes))
    check_node = (f"start `{layout.command()} --nproc-per-node {per_node} ...` on that node (<i>: its number) with "
                  f"the same {slurm_gang.SECRET_VAR}, or give it longer (--rdzv-conf join_timeout=SECONDS)")  # fmt: skip
    gang = GangContext(address, layout.port, addresses, (per_node,) * layout.nodes, node, 0.0, secret,
                       join_within=layout.join_timeout, check_node=check_node)  # fmt: skip
    return NodePlace(gang, slurm_gang.launcher_job(gang, env, run_id=f"torchrun-{layout.run_id}"), server)


def _listen(layout: NodeLayout, address: str) -> Any:
    """Node 0's control store server on the master address and port; None where this launcher is not node 0 (static:
    --node-rank is not 0; c10d: is_host=0, or the endpoint is another machine's or another launcher's already)."""
    if layout.node_rank not in (None, 0) or layout.is_host is False:
        return None
    try:
        return serve_store(address, layout.port)[0]
    except OSError as exc:
        if layout.node_rank is None and layout.is_host is None and exc.errno in (errno.EADDRNOTAVAIL, errno.EADDRINUSE):
            return None  # c10d: another launcher hosts the rendezvous
        raise LauncherEnvError(
            f"node 0 could not listen on {address}:{layout.port} (from {layout.host}) for the levers9 store of this "
            f"run ({exc.strerror}). Expected {layout.host} to be an address of this machine and port {layout.port} free: "
            f"start node 0 where {layout.host} points, or pass another --master-port (--rdzv-endpoint port) on every node."
        ) from exc


def _reach_node_zero(layout: NodeLayout, address: str, secret: str, expected: tuple[str, int, int]) -> ControlStore:
    """A client of node 0's store once node 0 says what the run is, within join_timeout; NodeLost when nothing of this
    run listened there in time, LauncherEnvError when node 0 runs another run id, per-node count or node count."""
    import torch.distributed as td

    deadline = time.monotonic() + layout.join_timeout
    never = (f"Expected node 0's launcher (`{layout.command('0')} ...`) running with the same {slurm_gang.SECRET_VAR}; "
             f"start it, check that this machine reaches {layout.host}:{layout.port}, or give it longer with "
             f"--rdzv-conf join_timeout=SECONDS.")  # fmt: skip
    try:
        client = td.TCPStore(address, layout.port, None, False, datetime.timedelta(seconds=layout.join_timeout))
    except (RuntimeError, OSError) as exc:
        raise NodeLost(f"levers9 run: no launcher listened on {address}:{layout.port} (from {layout.host}) within "
                       f"{layout.join_timeout:g} s ({type(exc).__name__}). {never}", address) from exc  # fmt: skip
    store = ControlStore.under_secret(client, secret)
    while (opened := store.rendezvous()) is None:
        if time.monotonic() >= deadline:
            raise NodeLost(f"levers9 run: something answers at {address}:{layout.port} (from {layout.host}), but no "
                           f"run with this {slurm_gang.SECRET_VAR} opened there within {layout.join_timeout:g} s. "
                           f"{never}", address)  # fmt: skip
        time.sleep(0.05)
    if tuple(opened) != expected:
        theirs, mine = _spelled(opened), _spelled(expected)
        raise LauncherEnvError(f"node 0 at {layout.host}:{layout.port} runs {theirs}, but this launcher was started "
                               f"with {mine}. Expected the same on every node: start every launcher with {theirs}.")  # fmt: skip
    return store


def _spelled(layout: tuple[str, int, int]) -> str:
    run_id, per_node, nodes = layout
    return f"--rdzv-id {run_id} --nproc-per-node {per_node} --nnodes {nodes}"


def _address_towards(address: str, port: int) -> str:
    """This machine's address on the route to `address` (what node 0 sees this node as)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((address, port))  # a datagram socket sends nothing on connect: it only picks the route
        return str(probe.getsockname()[0])


def _node_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    try:
        pair = (int(low), int(high or low))
    except ValueError:
        pair = (0, 0)
    if not 1 <= pair[0] <= pair[1]:
        raise ConfigError(f"--nnodes {text!r}; expected a whole number of nodes, or MIN:MAX with 1 <= MIN <= MAX, "
                          f"e.g. --nnodes 2.")  # fmt: skip
    return pair


def _whole(flag: str, text: str) -> int:
    if not text.isdigit():
        raise ConfigError(f"{flag} {text!r}; expected a whole number >= 0, e.g. {flag} 0.")
    return int(text)


def _port(flag: str, text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ConfigError(f"{flag} {text!r}; expected a port from 1 to 65535 that every node uses, e.g. {flag} 29500.")
    return int(text)


def _endpoint(text: str, default_port: int) -> tuple[str, int]:
    """HOST[:PORT] (an IPv6 host in brackets) as (host, port)."""
    host, colon, port = text.rpartition(":")
    if not colon or host.count(":") and not host.startswith("["):
        host, port = text, ""
    host = host.strip("[]")
    if not host:
        raise ConfigError(f"--rdzv-endpoint {text!r}; expected HOST:PORT, e.g. --rdzv-endpoint node0:29400.")
    return host, _port("--rdzv-endpoint's port", port) if port else default_port


def _rdzv_conf(text: str) -> dict[str, str]:
    """--rdzv-conf 'key=value,key=value' as a dict (torchrun's spelling)."""
    conf = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, equals, value = item.partition("=")
        if not equals or not key.strip():
            raise ConfigError(f"--rdzv-conf {text!r}; expected key=value pairs separated by commas, e.g. "
                              f"--rdzv-conf join_timeout=900.")  # fmt: skip
        conf[key.strip()] = value.strip()
    return conf


def _seconds(key: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise ConfigError(f"--rdzv-conf {key}={text}; expected a positive number of seconds, e.g. {key}=600.")
    return value


def _truth(key: str, text: str) -> bool:
    words = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
    if text.lower() not in words:
        raise ConfigError(f"--rdzv-conf {key}={text}; expected 1 or 0 (true or false).")
    return words[text.lower()]
