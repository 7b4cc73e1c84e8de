"""Importable functions for the multi-node Ray tests (tests/test_ray_nodes.py): job bodies and their ranks."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "GROUP_WORLD_SIZE",
        "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "CUDA_VISIBLE_DEVICES", "GLOO_SOCKET_IFNAME",
        "NCCL_SOCKET_IFNAME", "LEVERS9_STORE_PORT")  # fmt: skip


TYPE = "RTXPro6000"  # the card type the test cluster's nodes declare


class NodeError(Exception):
    """Raised by a rank on purpose; pickles, so the caller gets this type back."""


def ray_node_of_this_process() -> str:
    """The node address of the nearest Ray worker or raylet among this process's ancestors (its Ray node)."""
    pid = os.getpid()
    while pid > 1:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().decode(errors="replace").split("\0")
        for arg in args:
            if arg.startswith(("--node-ip-address=", "--node_ip_address=")):  # a Ray worker's or its raylet's
                return arg.split("=", 1)[1]
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    return "?"


def describe_rank(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's variables, helpers and Ray node, gathered; the mean of the ranks (needs every rank)."""
    import torch.distributed as td

    from levers9 import distributed as dist

    print(f"hello from rank {dist.rank()}", flush=True)
    mine = {name: os.environ.get(name) for name in VARS}
    mine.update(rank=dist.rank(), world=dist.world_size(), node_rank=dist.node_rank(), local_rank=dist.local_rank(),
                ray_node=ray_node_of_this_process(), td_rank=td.get_rank(), mean=float(dist.all_reduce_mean(float(dist.rank()))))  # fmt: skip
    gathered: list[Any] = [None] * td.get_world_size()
    td.all_gather_object(gathered, mine)
    return gathered


def store_keys_seen_from_outside(cfg: dict[str, Any]) -> dict[str, Any]:
    """On rank 0: which keys the ranks and agents read could be named on the job's two stores (the control store
    and the ranks' rendezvous store, both on the cluster network) by someone who has all but the job's secret."""
    import datetime

    import torch.distributed as td

    from levers9 import distributed as dist
    from levers9.runtime import current_job

    dist.barrier()
    if dist.rank() != 0:
        return {}
    job = current_job()
    assert job is not None and job.gang is not None
    secret = job.gang.secret

    def present(addr: str, port: int, keys: list[str]) -> list[str]:
        store = td.TCPStore(addr, port, None, False, datetime.timedelta(seconds=10))
        return [k for k in keys if store.check([k])]

    control = (job.gang.control_addr, job.gang.control_port)
    ranks = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    gloo = [f"/0//cpu//0/{r}" for r in range(dist.world_size())]
    return {
        "secret": secret,
        "control_guessed": present(*control, ["ready/1", "a0/start"]),
        "control_with_secret": present(*control, [f"levers9-{secret}/ready/1", f"levers9-{secret}/a0/start"]),
        "ranks_guessed": present(*ranks, [f"levers9-group-1/{k}" for k in gloo]),
        "ranks_with_secret": present(*ranks, [f"levers9-{secret}-group-1/{k}" for k in gloo]),
    }


def train(cfg: dict[str, Any]) -> Any:
    """A job body: dist.run on every card the job holds."""
    from levers9 import distributed as dist

    return dist.run(globals()[cfg["fn"]], cfg, **cfg.get("run", {}))


def train_twice(cfg: dict[str, Any]) -> Any:
    """A job body that calls dist.run twice: both runs use every node."""
    from levers9 import distributed as dist

    return [dist.run(globals()[cfg["fn"]], cfg) for _ in range(2)]


def train_then_hold(cfg: dict[str, Any]) -> Any:
    """A job body: dist.run of `mark_parent` on every card; then write the control store's address, port and
    secret and this process's parent (node 0's Ray task) to cfg['mark'], and return the result once
    cfg['mark'].go exists."""
    from levers9 import distributed as dist
    from levers9.runtime import current_job

    result = dist.run(mark_parent, cfg)
    job = current_job()
    assert job is not None and job.gang is not None
    Path(cfg["mark"]).write_text(f"{job.gang.control_addr} {job.gang.control_port} {os.getppid()} {job.gang.secret}")
    while not Path(cfg["mark"] + ".go").exists():
        time.sleep(0.02)
    return result


def mark_parent(cfg: dict[str, Any]) -> float:
    """Write this rank's pid, its parent's and its Ray node to cfg['mark'].<rank>; return the mean of the ranks."""
    from levers9 import distributed as dist

    Path(cfg["mark"] + f".{dist.rank()}").write_text(f"{os.getpid()} {os.getppid()} {ray_node_of_this_process()}")
    return float(dist.all_reduce_mean(float(dist.rank())))


def fail_first(cfg: dict[str, Any]) -> dict[str, Any]:
    """Rank 3 raises in the first attempt only; later attempts return the mean of the ranks and the attempt."""
    from levers9 import distributed as dist

    if dist.restart_count() == 0 and dist.rank() == 3:
        raise NodeError("rank 3 fails in the first attempt")
    return {"mean": float(dist.all_reduce_mean(float(dist.rank()))), "restart": dist.restart_count(), "pid": os.getpid()}


def fail_on(cfg: dict[str, Any]) -> None:
    """Every rank joins a collective; rank cfg['rank'] instead writes when it fails to cfg['mark'] and fails."""
    from levers9 import distributed as dist

    dist.all_reduce_mean(1.0)  # every rank is up
    if dist.rank() == cfg["rank"]:
        Path(cfg["mark"]).write_text(f"{time.time()} {os.getpid()} {os.getppid()} {ray_node_of_this_process()}")
        if cfg["how"] == "raise":
            raise NodeError(f"rank {dist.rank()} fails on purpose")
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    dist.all_reduce_mean(1.0)  # the others wait here for the failed rank
    time.sleep(120)


def fail_apart(cfg: dict[str, Any]) -> None:
    """Every rank joins a collective; then rank cfg['first'] raises NodeError, and rank cfg['second'] raises KeyError
    cfg['gap'] s after the first's failure was recorded (the first's mark at cfg['mark'], made at its process's
    exit, after levers9 captured and sent its failure, so a busy machine cannot put the two in the other order);
    the others wait in a collective."""
    import atexit

    from levers9 import distributed as dist

    dist.all_reduce_mean(1.0)  # every rank is up
    mark = Path(cfg["mark"])
    if dist.rank() == cfg["first"]:
        atexit.register(mark.touch)
        raise NodeError(f"rank {dist.rank()} fails first")
    if dist.rank() == cfg["second"]:
        while not mark.exists():
            time.sleep(0.002)
        time.sleep(cfg["gap"])
        raise KeyError(f"rank {dist.rank()} fails second")
    dist.all_reduce_mean(1.0)  # the others wait here for the failed ranks
    time.sleep(120)


def park(cfg: dict[str, Any]) -> None:
    """Every rank writes its pid and parent's pid, then waits in a collective (for the test to break a node)."""
    from levers9 import distributed as dist

    dist.all_reduce_mean(1.0)
    Path(cfg["mark"] + f".{dist.rank()}").write_text(f"{os.getpid()} {os.getppid()} {ray_node_of_this_process()}")
    time.sleep(0.5)
    dist.all_reduce_mean(1.0)  # blocks: the test never lets rank 0 leave... until a node is lost
    time.sleep(120)


def park_first(cfg: dict[str, Any]) -> dict[str, Any]:
    """The first attempt parks as `park` does (for the test to break a node); a restart returns the attempt and
    every rank's variables and Ray node."""
    from levers9 import distributed as dist

    if dist.restart_count() == 0:
        park(cfg)
    return {"restart": dist.restart_count(), "ranks": describe_rank(cfg)}


def stall_on(cfg: dict[str, Any]) -> None:
    """Every rank joins a collective; then rank cfg['rank'] writes when it stalls to cfg['mark'] and sleeps
    instead of joining the next one, which the others wait in."""
    from levers9 import distributed as dist

    dist.all_reduce_mean(1.0)
    if dist.rank() == cfg["rank"]:
        Path(cfg["mark"]).write_text(f"{time.time()}")
        time.sleep(300)
    dist.all_reduce_mean(1.0)


def long_line_on(cfg: dict[str, Any]) -> None:
    """Rank cfg["rank"] prints one line of cfg["size"] bytes (procfns.pattern), then a short one."""
    from levers9 import distributed as dist
    from tests import procfns

    if dist.rank() == cfg["rank"]:
        procfns.long_line(cfg["size"])
