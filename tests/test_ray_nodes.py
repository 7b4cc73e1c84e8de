"""One training across two Ray nodes (issue 25): planning, torchrun's world on every rank, failures named across nodes.

A module-scoped cluster of two Ray nodes on this machine, each on its own loopback address (127.0.0.2 and
127.0.0.3; Ray rewrites 127.0.0.1), each with 1 CPU and 2 logical GPUs declared as levers9_RTXPro6000 (no
NVML card behind them: the job layer runs the ranks on gloo, on the CPU), and a head node without cards
(127.0.0.4), so that a test can remove either card node outright without ending the cluster. The session's
one-node Ray (tests/ray_cluster.py) is shut down first if an earlier module started it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from levers9.errors import InfeasibleJobError, NodeLost, RankCrashed
from levers9.launch import job
from levers9.launch.settings import runs_dir, update_settings
from levers9.launch.spec import build_spec
from tests import nodefns, ray_cluster

pytestmark = pytest.mark.ray
NODES = ("127.0.0.2", "127.0.0.3")
HEAD = "127.0.0.4"
SPARE = "127.0.0.5"  # a node added, then removed, by the replacement test
TYPE = nodefns.TYPE
NODE_ARGS: dict[str, Any] = dict(num_cpus=1, num_gpus=2, resources={f"levers9_{TYPE}": 2}, object_store_memory=100 * 2**20)
_TMPDIR: list[str] = []  # the cluster's temp root: nodes added later keep their files there too


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Two Ray nodes, 2 simulated cards each, short health checks; everything removed afterwards (Ray's logs
    kept in pytest's temp folder when a test of the module failed: see `keep_ray_logs`)."""
    failed_before = request.session.testsfailed
    import ray
    from ray.cluster_utils import Cluster

    ray_cluster.release()
    root = tempfile.mkdtemp(prefix="l9nodes-", dir="/tmp")
    saved = {k: v for k, v in os.environ.items() if k.startswith("LEVERS9_") or k == "TMPDIR"}
    for key in saved:
        del os.environ[key]
    os.environ["TMPDIR"] = root
    made = None
    try:
        made = Cluster(initialize_head=True, head_node_args=dict(
            node_ip_address=HEAD, include_dashboard=False, num_cpus=1, num_gpus=0, object_store_memory=100 * 2**20,
            _system_config={"health_check_period_ms": 1000, "health_check_failure_threshold": 3, **ray_cluster.WORKERS_AT_NICE_0}))  # fmt: skip
        for address in NODES:
            made.add_node(node_ip_address=address, **NODE_ARGS)
        made.wait_for_nodes()
        ray.init(address=made.address, _node_ip_address=HEAD, log_to_driver=False)
    except BaseException:
        if made is not None:
            made.shutdown()
        shutil.rmtree(root, ignore_errors=True)
        raise
    finally:
        os.environ.pop("TMPDIR", None)
        os.environ.update(saved)
    _TMPDIR[:] = [root]
    try:
        yield made
    finally:
        ray.shutdown()
        made.shutdown()
        if request.session.testsfailed > failed_before:
            keep_ray_logs(Path(root), tmp_path_factory.mktemp("ray-nodes-logs"))
        shutil.rmtree(root, ignore_errors=True)


def keep_ray_logs(root: Path, into: Path) -> None:
    """Copy the cluster's Ray logs to `into`, and warn (pytest's warnings summary shows it, in CI too) with
    every worker Ray saw die of a system error: when, where, and the last lines of its own logs. Some
    tests kill workers on purpose (agents, the store host, a node task after its job); any other death is news."""
    logs = sorted(root.glob("ray/session_*/logs"))
    lines = [f"a test of {__name__} failed; Ray's logs of its cluster are kept in {into}"]
    for folder in logs:
        shutil.copytree(folder, into / folder.parent.name, ignore=shutil.ignore_patterns("events", "old"))
        for exit_line in (folder / "gcs_server.out").read_text(errors="replace").splitlines():
            found = re.search(r"^\[([^\]]+)\].*Reporting worker exit, worker id = (\w+).*?address = ([\d.]+), "
                              r"exit_type = SYSTEM_ERROR", exit_line)  # fmt: skip
            if found is None:
                continue
            when, worker, address = found.groups()
            lines.append(f"worker {worker[:12]} on {address} died at {when}:")
            for own in sorted(folder.glob(f"*{worker}*")):
                tail = own.read_text(errors="replace").splitlines()[-6:]
                lines += [f"  {own.name}:"] + [f"    {line[:300]}" for line in tail]
    warnings.warn("\n".join(lines), stacklevel=1)


@pytest.fixture
def on_cluster(cluster: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The multi-GPU switch on, every card free again as Ray counts them (Ray frees an earlier test's cards some
    time after its processes are gone, and a loaded machine can make that minutes), and a marker in every job's
    environment to find its processes by."""
    import ray

    update_settings(multi_gpu=True)
    cards = len(NODES) * NODE_ARGS["resources"][f"levers9_{TYPE}"]
    deadline = time.monotonic() + 120
    while ray.available_resources().get(f"levers9_{TYPE}", 0) < cards:
        assert time.monotonic() < deadline, f"Ray still counts cards in use 120 s on: {ray.available_resources()}"
        time.sleep(0.2)
    yield f"l9nodes-{os.getpid()}-{time.monotonic_ns()}"


def processes_with(marker: str) -> list[int]:
    """Pids of live processes whose environment holds L9_NODES_TEST=marker (the job's and its ranks')."""
    found = []
    needle = f"L9_NODES_TEST={marker}".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                continue
    return found


def nothing_left(marker: str, within: float = 15.0) -> None:
    deadline = time.monotonic() + within
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_with(marker) == [], "processes of the job are left"


def gang_job(marker: str, gpu_count: int = 4, **kwargs: Any) -> Any:
    return job(gpu=TYPE, gpu_count=gpu_count, backend="ray", timeout=150, env={"L9_NODES_TEST": marker},
               stop_grace=2.0, **kwargs)(nodefns.train)  # fmt: skip


def wait_for(path: Path, job: Any = None, within: float = 240.0) -> str:
    """The text of `path` once a rank wrote it; fails when `within` s pass first (on a loaded machine four ranks
    on two Ray nodes have taken 2 minutes to start), or at once when `job` (the job's Future) ended without it,
    saying how it ended."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        if job is not None and job.done():
            raise AssertionError(f"{path} was never written: the job ended first ({job.exception()!r})")
        time.sleep(0.05)
    raise AssertionError(f"{path} was never written")


def remove_node(cluster: Any, address: str) -> None:
    """Remove the Ray node at `address` outright (no graceful shutdown): its raylet and every process on it die."""
    (gone,) = [n for n in cluster.worker_nodes if n.node_ip_address == address]
    cluster.remove_node(gone, allow_graceful=False)


def card_nodes(cluster: Any) -> set[str]:
    """The addresses of the card nodes the cluster runs now (Ray's own view lags a removal by its health checks)."""
    return {n.node_ip_address for n in cluster.worker_nodes}


def add_node(cluster: Any, address: str) -> None:
    """A card node at `address`, as the fixture made them, in the cluster once Ray counts it alive."""
    import ray

    before = {n["NodeID"] for n in ray.nodes()}
    os.environ["TMPDIR"] = _TMPDIR[0]
    try:
        cluster.add_node(node_ip_address=address, **NODE_ARGS)
    finally:
        del os.environ["TMPDIR"]
    deadline = time.monotonic() + 60
    while not any(n["Alive"] and n["NodeManagerAddress"] == address and n["NodeID"] not in before for n in ray.nodes()):
        assert time.monotonic() < deadline, f"the node at {address} never came up"
        time.sleep(0.2)


# ---- planning as a pure function -----------------------------------------------------------------------


def node(address: str, gpus: int) -> Any:
    from levers9.launch.ray.gang import Node

    return Node(address, {"CPU": 8.0, "GPU": float(gpus), f"levers9_{TYPE}": float(gpus)})


def test_split_takes_the_fewest_nodes_of_equal_shares() -> None:
    from levers9.launch.ray.gang import split

    assert split(4, [2, 2]) == (2, 2)
    assert split(16, [8, 8, 8]) == (2, 8)
    assert split(12, [8, 6, 6]) == (2, 6)  # two nodes of 6, never 8 + 4
    assert split(12, [4, 4, 4, 3]) == (3, 4)
    assert split(3, [2, 2]) is None  # 3 splits only into 3 x 1, and there are two nodes
    assert split(6, [2, 2]) is None


def test_an_uneven_split_is_refused_with_a_table_of_the_nodes() -> None:
    from levers9.launch.ray.backend import plan_job
    from levers9.launch.ray.gang import plan_gang

    spec = build_spec(name="cell", gpu=TYPE, gpu_count=3, timeout=None, retries=0, env=None, cpu=None, memory=None,
                      queue_timeout=None, stop_grace=10.0, stream_output=True)  # fmt: skip
    nodes = [node("10.0.0.1", 2), node("10.0.0.2", 2)]
    with pytest.raises(InfeasibleJobError) as single:
        plan_job(spec, nodes)
    with pytest.raises(InfeasibleJobError, match=r"(?s)split evenly.*10\.0\.0\.1 +2 .*10\.0\.0\.2 +2 ") as err:
        plan_gang(spec, nodes, single.value, None)
    assert "gpu_count=" in str(err.value)


INTERFACE_CHECK = """
set -e
ip link add l9dummy type veth peer name l9peer
ip addr add 192.0.2.10/24 dev l9dummy
ip link set l9dummy up
"$PY" -c '
from levers9.distributed.nodes import interface_of, socket_env
assert interface_of("127.0.0.3") == "lo"
assert interface_of("192.0.2.10") == "l9dummy", interface_of("192.0.2.10")
assert socket_env("192.0.2.10", {}) == {"GLOO_SOCKET_IFNAME": "l9dummy", "NCCL_SOCKET_IFNAME": "l9dummy"}
assert socket_env("192.0.2.10", {"NCCL_SOCKET_IFNAME": "ib0"}) == {"GLOO_SOCKET_IFNAME": "l9dummy"}  # the user wins
assert interface_of("203.0.113.77") is None and socket_env("203.0.113.77", {}) == {}
print("interfaces ok")
'
"""


def test_ranks_talk_on_the_interface_that_carries_the_node_address() -> None:
    """In a network namespace of the test's own, with a veth interface carrying a documentation address
    (CI's tests run where only loopback exists, and the host's interfaces are not the test's to change)."""
    import subprocess

    if os.geteuid() != 0 or subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode != 0:
        pytest.fail("this test needs root and `unshare --net` (CI runs as root); run it as root")
    done = subprocess.run(["unshare", "--net", "sh", "-c", INTERFACE_CHECK], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PY": sys.executable, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})  # fmt: skip
    assert done.returncode == 0 and "interfaces ok" in done.stdout, done.stdout + done.stderr


# ---- on the two-node cluster ---------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_four_cards_run_as_two_nodes_of_two(on_cluster: str) -> None:
    ranks = gang_job(on_cluster).remote({"fn": "describe_rank"})
    by_rank = {r["rank"]: r for r in ranks}
    assert sorted(by_rank) == [0, 1, 2, 3]
    assert {by_rank[0]["ray_node"], by_rank[1]["ray_node"]} != {by_rank[2]["ray_node"]}
    assert by_rank[0]["ray_node"] == by_rank[1]["ray_node"] and by_rank[2]["ray_node"] == by_rank[3]["ray_node"]
    assert {r["ray_node"] for r in ranks} == set(NODES)
    for r in ranks:
        node_rank = r["rank"] // 2
        assert (r["RANK"], r["LOCAL_RANK"], r["WORLD_SIZE"], r["LOCAL_WORLD_SIZE"]) == (str(r["rank"]), str(r["rank"] % 2), "4", "2")
        assert (r["GROUP_RANK"], r["NODE_RANK"], r["GROUP_WORLD_SIZE"]) == (str(node_rank), str(node_rank), "2")
        assert (r["node_rank"], r["local_rank"], r["world"], r["td_rank"]) == (node_rank, r["rank"] % 2, 4, r["rank"])
        assert r["MASTER_ADDR"] == by_rank[0]["ray_node"] and r["MASTER_PORT"] == by_rank[0]["MASTER_PORT"]
        assert r["TORCHELASTIC_USE_AGENT_STORE"] == "True" and r["LEVERS9_STORE_PORT"] is None
        assert len(r["CUDA_VISIBLE_DEVICES"].split(",")) == 2  # only its node's cards
        assert r["GLOO_SOCKET_IFNAME"] == r["NCCL_SOCKET_IFNAME"] == "lo"  # the interface of 127.0.0.x
        assert r["mean"] == 1.5
    (meta,) = runs_dir().glob("*/0000-1/meta.json")  # what the status line and `levers9 runs` show
    plan = f"4 x {TYPE} as 2 nodes x 2: {by_rank[0]['ray_node']}, {by_rank[2]['ray_node']}"
    assert json.loads(meta.read_text())["node"] == plan
    printed = (meta.parent / "stdout.log").read_text().splitlines()  # every node's rank output reaches the caller
    assert "hello from rank 0" in printed and {"[rank 1] hello from rank 1", "[rank 2] hello from rank 2",
                                               "[rank 3] hello from rank 3"} <= set(printed), printed  # fmt: skip
    nothing_left(on_cluster)


@pytest.mark.timeout(180)
def test_the_keys_on_the_jobs_stores_need_the_jobs_secret(on_cluster: str) -> None:
    """Both stores listen on the cluster network, and what the agents read there is unpickled: whoever can reach
    them but was not handed the job's secret by Ray can name none of the keys that are read."""
    seen = gang_job(on_cluster).remote({"fn": "store_keys_seen_from_outside"})
    assert len(seen["secret"]) == 32
    assert seen["control_guessed"] == [] and seen["ranks_guessed"] == []
    assert len(seen["control_with_secret"]) == 2 and len(seen["ranks_with_secret"]) == 4
    nothing_left(on_cluster)


@pytest.mark.timeout(120)
def test_two_cards_stay_on_one_node_on_loopback(on_cluster: str) -> None:
    ranks = gang_job(on_cluster, gpu_count=2).remote({"fn": "describe_rank"})
    assert len({r["ray_node"] for r in ranks}) == 1
    assert all(r["MASTER_ADDR"] == "127.0.0.1" and r["GROUP_WORLD_SIZE"] == "1" and r["node_rank"] == 0 for r in ranks)
    assert all(r["LEVERS9_STORE_PORT"] == r["MASTER_PORT"] for r in ranks)
    assert [r["mean"] for r in ranks] == [0.5, 0.5]


def test_doctor_shows_the_plan(on_cluster: str, capsys: pytest.CaptureFixture[str]) -> None:
    from levers9.cli import main as cli_main

    assert cli_main(["doctor", "--ray-plan", f"{TYPE}:4"]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"Ray plan\n  4 x {TYPE} as 2 nodes x 2: 127\.0\.0\.[23], 127\.0\.0\.[23] ", out), out
    assert cli_main(["doctor", "--ray-plan", f"{TYPE}:2"]) == 0
    assert f"Ray plan\n  2 x {TYPE} on one node" in capsys.readouterr().out
    assert cli_main(["doctor", "--ray-plan", f"{TYPE}:3"]) == 0
    assert "split evenly" in capsys.readouterr().out


def test_three_cards_are_refused_at_once_with_the_table(on_cluster: str) -> None:
    started = time.monotonic()
    with pytest.raises(InfeasibleJobError, match=r"split evenly") as err:
        gang_job(on_cluster, gpu_count=3).remote({"fn": "describe_rank"})
    for address in NODES:
        assert re.search(rf"\n  {re.escape(address)} +2 \(\d free\) +1\n", str(err.value) + "\n"), str(err.value)
    assert "gpu_count=2 or gpu_count=4" in str(err.value)
    assert time.monotonic() - started < 5
    assert processes_with(on_cluster) == []


LONG_LINE_CALLER = """
import json, sys, threading, time
import ray
from levers9.launch import job
from tests import nodefns

def private_memory() -> int:  # RssAnon: what this process holds itself (Ray's shared object store pages aside)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

peak, sampling = [0], threading.Event()

def sample() -> None:
    while not sampling.wait(0.002):
        peak[0] = max(peak[0], private_memory())

address, head, marker, size, into = sys.argv[1:]
ray.init(address=address, _node_ip_address=head, log_to_driver=False)
train = job(gpu=nodefns.TYPE, gpu_count=4, backend="ray", timeout=150, env={"L9_NODES_TEST": marker}, stop_grace=2.0)(nodefns.train)
train.remote({"fn": "long_line_on", "rank": 2, "size": 1000})  # everything a job loads, loaded before the peak is read
before = private_memory()
sampler = threading.Thread(target=sample)
sampler.start()
train.remote({"fn": "long_line_on", "rank": 2, "size": int(size)})
sampling.set()
sampler.join()
with open(into, "w") as f:
    json.dump({"before": before, "after": peak[0]}, f)
"""


@pytest.mark.timeout(240)
def test_a_100_mb_line_of_a_rank_on_the_second_node_reaches_the_caller_in_bounded_memory(
    cluster: Any, on_cluster: str, tmp_path: Path
) -> None:
    """The line streams in pieces from the rank to the agent, node 0, its Ray task and the caller (a process of
    its own, so that its peak memory is its own): the caller's private memory, sampled every 2 ms, grows by far
    less than the line."""
    import subprocess

    from tests import procfns

    size = 100 << 20
    into = tmp_path / "peak.json"
    done = subprocess.run([sys.executable, "-c", LONG_LINE_CALLER, cluster.address, HEAD, on_cluster, str(size), str(into)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=220, cwd=Path(__file__).parent.parent)  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    peak = json.loads(into.read_text())
    grew = peak["after"] - peak["before"]
    print(f"the caller's private memory grew by at most {grew / 2**20:.1f} MB for a {size >> 20} MB line")
    assert grew < size // 4, peak
    (log,) = [p for p in runs_dir().glob("*/0000-1/stdout.log") if p.stat().st_size > size]
    assert b"[rank 2] " + procfns.pattern(size) + b"\n[rank 2] after the long line\n" in log.read_bytes()
    nothing_left(on_cluster)


@pytest.mark.timeout(180)
def test_a_rank_raising_on_the_second_node_is_named(on_cluster: str, tmp_path: Path) -> None:
    mark = tmp_path / "failed"
    with pytest.raises(nodefns.NodeError, match="rank 3 fails on purpose") as err:
        gang_job(on_cluster).remote({"fn": "fail_on", "rank": 3, "how": "raise", "mark": str(mark)})
    when, pid, _, ray_node = mark.read_text().split()
    seconds = time.time() - float(when)
    note = "\n".join(getattr(err.value, "__notes__", []))
    assert f"rank 3 (pid {pid}) on node 1 ({ray_node})" in note, note
    assert 'in fail_on\n    raise NodeError(f"rank {dist.rank()} fails on purpose")' in note
    print(f"raise on node 1 named after {seconds:.2f} s")
    assert seconds < 10
    nothing_left(on_cluster)


@pytest.mark.timeout(180)
def test_of_two_ranks_failing_apart_on_two_nodes_the_first_in_time_is_named(on_cluster: str, tmp_path: Path) -> None:
    """Rank 3 (node 1) raises, rank 1 (node 0) raises 50 ms later: rank 3 is named, with its own exception type, as
    on one machine and on SLURM (tests/test_backend_contract.py)."""
    cfg = {"fn": "fail_apart", "first": 3, "second": 1, "gap": 0.05, "mark": str(tmp_path / "first-failed")}
    with pytest.raises(nodefns.NodeError, match="rank 3 fails first") as err:
        gang_job(on_cluster).remote(cfg)
    assert "rank 3 (pid" in "\n".join(getattr(err.value, "__notes__", [])) and "on node 1" in "\n".join(err.value.__notes__)
    nothing_left(on_cluster)


@pytest.mark.timeout(180)
def test_a_rank_killed_on_the_second_node_is_named(on_cluster: str, tmp_path: Path) -> None:
    mark = tmp_path / "failed"
    with pytest.raises(RankCrashed) as err:
        gang_job(on_cluster).remote({"fn": "fail_on", "rank": 2, "how": "kill", "mark": str(mark)})
    when, pid, _, ray_node = mark.read_text().split()
    seconds = time.time() - float(when)
    assert f"rank 2 (pid {pid}) on node 1 ({ray_node}) was killed by SIGKILL" in str(err.value), str(err.value)
    assert err.value.failure is not None and err.value.failure.signal == signal.SIGKILL
    print(f"SIGKILL on node 1 named after {seconds:.2f} s")
    assert seconds < 10
    nothing_left(on_cluster)


@pytest.mark.timeout(360)
def test_a_lost_agent_is_named_by_the_heartbeat(on_cluster: str, tmp_path: Path) -> None:
    import concurrent.futures

    mark = tmp_path / "parked"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(gang_job(on_cluster).remote, {"fn": "park", "mark": str(mark)})
        _, agent, ray_node = wait_for(Path(f"{mark}.2"), future).split()  # rank 2's parent: node 1's agent, a Ray worker
        os.kill(int(agent), signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(NodeLost, match=rf"lost node 1 \({re.escape(ray_node)}, ranks 2-3\)") as err:
            future.result(timeout=60)
        seconds = time.monotonic() - killed
    assert err.value.node == ray_node and err.value.ranks == (2, 3)
    print(f"agent killed on node 1, NodeLost after {seconds:.2f} s")
    assert seconds < 10
    nothing_left(on_cluster)


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.timeout(360)
def test_a_frozen_node_is_named_by_the_heartbeat(on_cluster: str, tmp_path: Path) -> None:
    import concurrent.futures

    mark = tmp_path / "parked"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(gang_job(on_cluster).remote, {"fn": "park", "mark": str(mark)})
        rank2, agent, ray_node = wait_for(Path(f"{mark}.2"), future).split()
        rank3 = wait_for(Path(f"{mark}.3"), future).split()[0]
        frozen = [int(agent), int(rank2), int(rank3)]  # node 1's agent and ranks: no packet leaves them
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            with pytest.raises(NodeLost, match=rf"lost node 1 \({re.escape(ray_node)}, ranks 2-3\)"):
                future.result(timeout=60)
            seconds = time.monotonic() - stopped
        finally:
            for pid in frozen:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
    print(f"node 1 frozen with SIGSTOP, NodeLost after {seconds:.2f} s")
    assert seconds < 10
    nothing_left(on_cluster)


# Over 20 s in the three-worker suite (about 12 s alone on 2 idle cores): a 4-rank job on two Ray nodes, the
# agent on node 1 killed, and a restart that starts a new agent there before every rank runs fn again.
@pytest.mark.timeout(360)
def test_a_lost_agent_is_replaced_and_the_restart_runs_on_every_node(on_cluster: str, tmp_path: Path) -> None:
    import concurrent.futures

    mark = tmp_path / "parked"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(gang_job(on_cluster, max_restarts=1).remote, {"fn": "park_first", "mark": str(mark)})
        _, agent, ray_node = wait_for(Path(f"{mark}.2"), future).split()
        os.kill(int(agent), signal.SIGKILL)  # the node stays: Ray runs the new agent in the same bundle there
        killed = time.monotonic()
        result = future.result(timeout=90)
        seconds = time.monotonic() - killed
    ranks = {r["rank"]: r for r in result["ranks"]}
    assert result["restart"] == 1 and sorted(ranks) == [0, 1, 2, 3]
    assert ranks[2]["ray_node"] == ranks[3]["ray_node"] == ray_node and {r["mean"] for r in ranks.values()} == {1.5}
    print(f"agent killed on node 1: back in fn on a new agent after {seconds:.2f} s")
    nothing_left(on_cluster)


def park_then_remove_node_1(cluster: Any, pool: Any, marker: str, mark: Path, queue_timeout: float) -> tuple[Any, str, float]:
    """Start a 4-card job with max_restarts=1 whose first attempt parks; once its ranks are up, remove the Ray node
    that holds ranks 2-3 outright. The job's future, that node's address, and when it was removed."""
    future = pool.submit(gang_job(marker, max_restarts=1, queue_timeout=queue_timeout).remote,
                         {"fn": "park_first", "mark": str(mark)})  # fmt: skip
    _, _, address = wait_for(Path(f"{mark}.2"), future).split()
    remove_node(cluster, address)
    return future, address, time.monotonic()


# Over 20 s (about 26 s on 2 idle cores): two runs, each losing a node to a real removal (5 s of heartbeat),
# the first then waiting out queue_timeout=6, and three Ray nodes started on the way.
@pytest.mark.timeout(360)
def test_a_removed_node_is_replaced_within_queue_timeout_or_named(cluster: Any, on_cluster: str, tmp_path: Path) -> None:
    """A card node removed outright while the ranks run, max_restarts=1: with no node to replace it the restart
    waits queue_timeout and fails naming it; with one, the restart runs there. The cluster ends as it began."""
    import concurrent.futures

    from levers9.errors import FailureKind

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future, lost, removed = park_then_remove_node_1(cluster, pool, on_cluster, tmp_path / "alone", queue_timeout=6)
        try:
            with pytest.raises(NodeLost, match=rf"lost node 1 \({re.escape(lost)}, ranks 2-3\)") as err:
                future.result(timeout=90)
            seconds = time.monotonic() - removed
            notes = "\n".join(getattr(err.value, "__notes__", []))
            assert err.value.kind is FailureKind.QUEUE and err.value.node == lost
            assert "no node replaced it within 6 s (the job's queue_timeout)" in str(err.value)
            assert "attempt 1" in notes and "attempt 2" in notes and "Add a node to the cluster" in notes, notes
            print(f"node removed, none to replace it: NodeLost after {seconds:.2f} s (queue_timeout=6)")
            nothing_left(on_cluster)

            add_node(cluster, SPARE)  # the card nodes are now the other one and SPARE
            future, _, removed = park_then_remove_node_1(cluster, pool, on_cluster, tmp_path / "b", queue_timeout=60)
        finally:
            for address in NODES:  # the node(s) removed come back: the replacement, and the cluster as it began
                if address not in card_nodes(cluster):
                    add_node(cluster, address)
        try:
            result = future.result(timeout=120)
            seconds = time.monotonic() - removed
        finally:
            if SPARE in card_nodes(cluster):
                remove_node(cluster, SPARE)
    ranks = {r["rank"]: r for r in result["ranks"]}
    assert result["restart"] == 1 and ranks[2]["ray_node"] == ranks[3]["ray_node"] != ranks[0]["ray_node"]
    assert {r["mean"] for r in ranks.values()} == {1.5}
    print(f"node removed, a new one added: back in fn on it after {seconds:.2f} s")
    nothing_left(on_cluster)


@pytest.mark.timeout(180)
def test_a_stall_on_the_second_node_is_named_with_node_and_rank(on_cluster: str, tmp_path: Path) -> None:
    from levers9.errors import StallError

    mark = tmp_path / "stalled"
    with pytest.raises(StallError) as err:
        gang_job(on_cluster).remote({"fn": "stall_on", "rank": 3, "mark": str(mark), "run": {"stall_timeout": 3}})
    seconds = time.time() - float(mark.read_text())
    text = str(err.value)
    node1 = re.search(r"rank 3 on node 1 \((127\.0\.0\.[23])\): not in a collective .* at \S*nodefns\.py:\d+ in stall_on", text)
    assert node1, text
    for rank, node in ((0, 0), (1, 0), (2, 1)):
        assert re.search(rf"rank {rank} on node {node} \(127\.0\.0\.[23]\): waiting", text), text
    assert "stall_timeout=3" in text and "Rank 3 on node 1" in text  # its stack, named the same way
    print(f"stall on node 1 named after {seconds:.2f} s (stall_timeout=3)")
    assert seconds < 3 + 10
    nothing_left(on_cluster)


@pytest.mark.timeout(360)
def test_losing_the_store_host_ends_every_node(on_cluster: str, tmp_path: Path) -> None:
    import concurrent.futures

    from levers9.errors import JobCrashed

    mark = tmp_path / "parked"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(gang_job(on_cluster).remote, {"fn": "park", "mark": str(mark)})
        _, job_process, _ = wait_for(Path(f"{mark}.0"), future).split()
        wait_for(Path(f"{mark}.2"), future)
        host = parent_of(int(job_process))  # node 0's Ray task: it hosts the control store
        os.kill(host, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(JobCrashed, match="lost the Ray task running it"):
            future.result(timeout=60)
        seconds = time.monotonic() - killed
    print(f"store host killed: the caller knew after {seconds:.2f} s")
    nothing_left(on_cluster)
    print(f"and nothing of the job was left on either node after {time.monotonic() - killed:.2f} s")


@pytest.mark.timeout(360)
def test_a_node_task_that_dies_after_the_job_ended_keeps_the_jobs_result(
    on_cluster: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The job's outcome has reached the caller; node 0's Ray task then waits for node 1's agent to end (frozen
    here) and its worker dies: the caller gets the job's result and a warning, not a lost job to run again."""
    import concurrent.futures
    import datetime

    import torch.distributed as td

    mark = tmp_path / "held"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(job(gpu=TYPE, gpu_count=4, backend="ray", timeout=150, env={"L9_NODES_TEST": on_cluster},
                                 stop_grace=2.0)(nodefns.train_then_hold).remote, {"mark": str(mark)})  # fmt: skip
        address, port, host, secret = wait_for(mark, future).split()
        agent = int(Path(f"{mark}.2").read_text().split()[1])  # rank 2's parent: node 1's agent
        os.kill(agent, signal.SIGSTOP)  # dist.run is over: nothing watches the agent until the task's clean-up
        try:
            (tmp_path / "held.go").touch()
            store = td.PrefixStore(f"levers9-{secret}", td.TCPStore(address, int(port), None, False,
                                                                    datetime.timedelta(seconds=30)))  # fmt: skip
            deadline = time.monotonic() + 60
            while not store.check(["end"]):  # set by node 0's task after the job ended, before it waits for agents
                assert time.monotonic() < deadline, "node 0's task never told the agents the job is over"
                time.sleep(0.02)
            del store
            os.kill(int(host), signal.SIGKILL)
            with caplog.at_level(logging.WARNING, logger="levers9.launch.ray"):
                result = future.result(timeout=60)
        finally:
            os.kill(agent, signal.SIGCONT)
    assert result == 1.5  # rank 0's value: the mean of the four ranks
    assert "the Ray task that ran it died after the job had ended" in caplog.text
    assert "the job's outcome stands" in caplog.text
    nothing_left(on_cluster)


@pytest.mark.timeout(180)
def test_a_restart_reforks_every_rank_on_every_node(on_cluster: str) -> None:
    result = gang_job(on_cluster, max_restarts=1).remote(
        {"fn": "fail_first", "run": {"restart_on": ("exception",), "restart_delay": 0}}
    )
    assert result["restart"] == 1 and result["mean"] == 1.5  # back in fn on all four ranks, in the second attempt
    nothing_left(on_cluster)


@pytest.mark.timeout(180)
def test_two_runs_in_one_job_both_use_every_node(on_cluster: str) -> None:
    fn = job(gpu=TYPE, gpu_count=4, backend="ray", timeout=150, env={"L9_NODES_TEST": on_cluster})(nodefns.train_twice)
    first, second = fn.remote({"fn": "describe_rank"})
    for ranks in (first, second):
        assert sorted(r["rank"] for r in ranks) == [0, 1, 2, 3] and {r["ray_node"] for r in ranks} == set(NODES)
    assert first[0]["MASTER_PORT"] != second[0]["MASTER_PORT"]  # each run hosts a fresh rendezvous store
    nothing_left(on_cluster)
