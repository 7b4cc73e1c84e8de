"""`levers9 run` across nodes as torchrun does it (`--nnodes`, `--node-rank`, c10d, Kubeflow's PET_* variables): two
launcher processes on this machine, 2 ranks each, side by side with torchrun's two on the same script."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from levers9.cli import build_parser
from levers9.cli import main as cli_main
from levers9.cli import run as run_cli
from levers9.distributed import torchrun_nodes
from levers9.errors import ConfigError
from tests.proc_util import children_of, free_port, left_behind

pytestmark = pytest.mark.launchers

REPO = Path(__file__).resolve().parents[1]
SCRIPT = str(REPO / "tests" / "scripts" / "node_ranks.py")
RESTART_SCRIPT = str(REPO / "tests" / "scripts" / "slurm_restart.py")
LEVERS9 = [sys.executable, "-m", "levers9", "run"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
SECRET = {"LEVERS9_GANG_SECRET": secrets.token_hex(16)}


@pytest.fixture(autouse=True)
def no_leftover_processes() -> Iterator[None]:
    before = set(children_of(os.getpid()))
    yield
    assert left_behind(before) == [], "a run left child processes running"


class Ended:
    """One launcher's outcome: its exit status, what it wrote, and when it ended (time.monotonic())."""

    def __init__(self, process: subprocess.Popen[str], out: str, err: str, at: float) -> None:
        self.returncode, self.stdout, self.stderr, self.at = process.returncode, out, err, at


def launch_nodes(command_of: Callable[[int], list[str]], env_of: Callable[[int], dict[str, str]],
                 nodes: int = 2, timeout: float = 240,
                 while_running: Callable[[list[subprocess.Popen[str]]], None] | None = None) -> list[Ended]:  # fmt: skip
    """Start node 0's .. node (nodes-1)'s launcher side by side, each in a process group of its own (whatever is left
    of a launcher that hangs is killed with it) and a $TMPDIR of the run's (torchrun's agent leaves folders there);
    `while_running(processes)` once all started; each one's outcome once all ended."""
    base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS" and not k.startswith("PET_")}
    base["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    ended: dict[int, Ended] = {}
    with tempfile.TemporaryDirectory() as tmp:
        processes = [subprocess.Popen(command_of(i), env={**base, "TMPDIR": tmp, **env_of(i)}, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, start_new_session=True)
                     for i in range(nodes)]  # fmt: skip

        def wait(i: int) -> None:
            out, err = processes[i].communicate()
            ended[i] = Ended(processes[i], out, err, time.monotonic())

        waiters = [threading.Thread(target=wait, args=(i,)) for i in range(nodes)]
        for waiter in waiters:
            waiter.start()
        try:
            if while_running is not None:
                while_running(processes)
            for waiter in waiters:
                waiter.join(max(0.0, timeout))
        finally:
            hung = [process.pid for process in processes if process.poll() is None]
            for pid in hung:
                os.killpg(pid, signal.SIGKILL)
            for waiter in waiters:
                waiter.join()
    assert not hung, f"launcher(s) {hung} hung and were killed"
    return [ended[i] for i in range(nodes)]


def _static(launcher: list[str], port: int, *extra: str) -> Callable[[int], list[str]]:
    return lambda i: [*launcher, "--nnodes", "2", "--node-rank", str(i), "--master-addr", "127.0.0.1",
                      "--master-port", str(port), "--nproc-per-node", "2", *extra]  # fmt: skip


def _form(form: str, launcher: list[str], port: int) -> tuple[Callable[[int], list[str]], Callable[[int], dict[str, str]]]:
    """The command and environment of node i's launcher for `form`: static options, Kubeflow's PET_* variables, or a
    c10d rendezvous (the same command on both nodes: they number themselves as they join)."""
    secret = SECRET if launcher is LEVERS9 else {}
    if form == "static":
        return (lambda i: [*_static(launcher, port)(i), SCRIPT]), (lambda i: secret)
    if form == "pet":
        pet = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port)}
        return (lambda i: [*launcher, SCRIPT]), (lambda i: {**secret, **pet, "PET_NODE_RANK": str(i)})
    c10d = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", "job7"]  # fmt: skip
    return (lambda i: [*launcher, *c10d, SCRIPT]), (lambda i: secret)


def ranks_seen(outs: list[Ended]) -> dict[int, dict[str, object]]:
    """Global rank -> the NODE_RANK line it printed, from every launcher's output (levers9's: node 0's)."""
    lines = [piece for e in outs for line in e.stdout.splitlines() for piece in line.split("NODE_RANK ")[1:]]
    return {int(seen["RANK"]): seen for seen in map(json.loads, lines)}


# Over 20 s in the three-worker suite: two levers9 launchers, then torchrun's two, each with 2 ranks importing torch.
@pytest.mark.timeout(420)
@pytest.mark.parametrize("form", ["static", "pet", "c10d"])
def test_two_launchers_give_torchruns_world_and_variables(form: str) -> None:
    ours = launch_nodes(*_form(form, LEVERS9, free_port()))
    theirs = launch_nodes(*_form(form, TORCHRUN, free_port()))
    assert [e.returncode for e in theirs] == [0, 0], theirs[0].stderr[-2000:] + theirs[1].stderr[-2000:]
    assert [e.returncode for e in ours] == [0, 0], ours[0].stderr[-2000:] + ours[1].stderr[-2000:]
    mine, torchruns = ranks_seen(ours), ranks_seen(theirs)
    assert sorted(mine) == sorted(torchruns) == [0, 1, 2, 3]
    # every node's rank output is printed on node 0, named by its rank: under c10d node 0 is whichever launcher
    # bound the endpoint first (the second one started can win on a busy machine), statically the first
    printed_by = [i for i, ended in enumerate(ours) if "NODE_RANK" in ended.stdout]
    assert printed_by == [0] or (form == "c10d" and printed_by == [1]), printed_by
    # c10d numbers the nodes as they join, so which launcher is node 0 may differ (each rank's place may not), and
    # torchrun's ranks get the hosting agent's host name where levers9's get the endpoint's address
    join_order = {"GROUP_RANK", "LOCAL_RANK", "MASTER_ADDR"} if form == "c10d" else set()
    differ_by_design = {"MASTER_PORT", "TORCHELASTIC_RUN_ID"} | join_order  # levers9 binds a fresh port per attempt
    for rank in range(4):
        for name, value in torchruns[rank].items():
            if name not in differ_by_design:
                assert mine[rank][name] == value, (rank, name, mine[rank][name], value)
        for seen in (mine[rank], torchruns[rank]):
            assert rank == 2 * int(str(seen["GROUP_RANK"])) + int(str(seen["LOCAL_RANK"]))
    assert {(r["sum"], r["world"], r["elastic"]) for r in mine.values()} == {(10.0, 4, True)}
    assert {r["GROUP_RANK"] for r in mine.values()} == {"0", "1"}
    assert {r["MASTER_ADDR"] for r in mine.values()} == {"127.0.0.1"}


@pytest.mark.timeout(300)
def test_a_rank_on_node_1_raising_ends_both_launchers_naming_it() -> None:
    """Both launchers exit 1, as torchrun's two do here (not run side by side: torchrun's node 0 took 47 s to give up
    on its ranks by hand, and once outlived the test's limit)."""
    port = free_port()
    ours = launch_nodes(lambda i: [*_static(LEVERS9, port)(i), SCRIPT, "raise"], lambda i: SECRET)
    node0, node1 = ours
    assert node0.returncode == 1, node0.stderr[-3000:]
    assert re.search(r"levers9 run: rank 2 \(pid \d+\) on node 1 \(127\.0\.0\.1\) raised ValueError: rank 2 could not "
                     r"read its shard; every other rank of 4 on 2 nodes was stopped", node0.stderr), node0.stderr[-3000:]
    assert "Traceback from rank 2:" in node0.stderr and "ValueError: rank 2 could not read its shard" in node0.stderr
    assert node1.returncode == 1, node1.stderr[-3000:]
    assert "the run across 2 nodes failed; node 0 (127.0.0.1) printed the failing rank" in node1.stderr
    assert abs(node0.at - node1.at) < 15, "one launcher outlived the other by more than a few seconds"


@pytest.mark.timeout(300)
def test_max_restarts_after_a_rank_on_node_1_is_killed_resumes_from_the_checkpoint(tmp_path: Path) -> None:
    port = free_port()
    ours = launch_nodes(lambda i: [*_static(LEVERS9, port)(i), "--max-restarts", "1", RESTART_SCRIPT, str(tmp_path)],
                        lambda i: SECRET)  # fmt: skip
    assert [e.returncode for e in ours] == [0, 0], ours[0].stderr[-3000:] + ours[1].stderr[-3000:]
    seen = sorted((json.loads(line.partition("ATTEMPT ")[2]) for line in ours[0].stdout.splitlines()
                   if "ATTEMPT {" in line), key=lambda r: r["rank"])  # fmt: skip
    assert [(r["rank"], r["attempt"], r["sum"], r["resumed"]) for r in seen] == [
        (0, 2, 4.0, "step 5"), (1, 2, 4.0, "step 5"), (2, 2, 4.0, "step 5"), (3, 2, 4.0, "step 5"),
    ]  # fmt: skip
    assert "rank 3" in ours[0].stderr and "SIGKILL" in ours[0].stderr  # the restart names what it cured


@pytest.mark.timeout(240)
def test_losing_node_0s_launcher_ends_node_1_naming_it(tmp_path: Path) -> None:
    """Node 0's launcher is SIGKILLed while every rank computes: its ranks go with it (their lifeline), and node 1's
    launcher stops its ranks and exits 1 naming node 0, within its heartbeat's limit."""
    killed_at: list[float] = []

    def kill_node_0(processes: list[subprocess.Popen[str]]) -> None:
        deadline = time.monotonic() + 180
        while len(list(tmp_path.glob("ready-*"))) < 4:  # every rank computes
            assert time.monotonic() < deadline and all(p.poll() is None for p in processes), "the ranks never all started"
            time.sleep(0.05)
        processes[0].kill()
        killed_at.append(time.monotonic())

    port = free_port()
    node0, node1 = launch_nodes(lambda i: [*_static(LEVERS9, port)(i), SCRIPT, "loop", str(tmp_path)], lambda i: SECRET,
                                while_running=kill_node_0)  # fmt: skip
    assert node0.returncode == -signal.SIGKILL
    assert node1.returncode == 1, node1.stderr[-3000:]
    assert "levers9 run: lost node 0 (127.0.0.1), whose launcher hosts the run's store" in node1.stderr, node1.stderr
    assert node1.at - killed_at[0] < 30, "node 1 outlived node 0 by more than its heartbeat's limit and a stop"


@pytest.mark.timeout(120)
def test_a_node_that_never_arrives_is_named_within_the_join_timeout() -> None:
    port = free_port()
    started = time.monotonic()
    (alone,) = launch_nodes(lambda i: [*_static(LEVERS9, port, "--rdzv-conf", "join_timeout=3")(0), SCRIPT],
                            lambda i: SECRET, nodes=1)  # fmt: skip
    assert alone.returncode == 1, alone.stderr[-3000:]
    assert "node 1 (not joined, ranks 2-3) never joined within 3 s" in alone.stderr, alone.stderr[-3000:]
    assert f"--nnodes 2 --node-rank <i> --master-addr 127.0.0.1 --master-port {port} --nproc-per-node 2" in alone.stderr
    assert "NODE_RANK" not in alone.stdout
    (orphan,) = launch_nodes(lambda i: [*_static(LEVERS9, free_port(), "--rdzv-conf", "join_timeout=3")(1), SCRIPT],
                             lambda i: SECRET, nodes=1)  # fmt: skip
    assert orphan.returncode == 1, orphan.stderr[-3000:]
    assert re.search(r"no launcher listened on 127\.0\.0\.1:\d+ \(from 127\.0\.0\.1\) within 3 s", orphan.stderr), orphan.stderr
    assert "--node-rank 0" in orphan.stderr and "join_timeout=SECONDS" in orphan.stderr
    assert time.monotonic() - started < 90


@pytest.mark.timeout(120)
def test_a_missing_secret_is_one_error_on_every_node() -> None:
    command, env = _form("pet", LEVERS9, free_port())
    ended = launch_nodes(command, lambda i: {k: v for k, v in env(i).items() if k != "LEVERS9_GANG_SECRET"})
    for e in ended:
        assert e.returncode == 2, e.stderr[-3000:]
        assert "levers9 run across 2 nodes (--nnodes 2) needs LEVERS9_GANG_SECRET" in e.stderr
        assert "export LEVERS9_GANG_SECRET=$(python -c 'import secrets; print(secrets.token_hex(16))')" in e.stderr
        assert "NODE_RANK" not in e.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("differs", ["rdzv-id", "secret"])
def test_launchers_of_different_runs_never_meet(differs: str) -> None:
    """A launcher of another run (another --rdzv-id), or of nobody's (another secret: it cannot read a key of the run's
    store), is refused by name, and node 0 names the node that never joined; no rank starts on either."""
    port = free_port()
    other = ["--rdzv-id", "other"] if differs == "rdzv-id" else []
    theirs = {"LEVERS9_GANG_SECRET": secrets.token_hex(16)} if differs == "secret" else SECRET
    ended = launch_nodes(lambda i: [*_static(LEVERS9, port, "--rdzv-conf", "join_timeout=10")(i), *(other if i else []),
                                    SCRIPT], lambda i: theirs if i else SECRET)  # fmt: skip
    if differs == "rdzv-id":
        assert ended[1].returncode == 2, ended[1].stderr[-3000:]
        assert (f"node 0 at 127.0.0.1:{port} runs --rdzv-id none --nproc-per-node 2 --nnodes 2, but this launcher was "
                f"started with --rdzv-id other") in ended[1].stderr
    else:
        assert ended[1].returncode == 1, ended[1].stderr[-3000:]
        assert f"something answers at 127.0.0.1:{port} (from 127.0.0.1), but no run with this LEVERS9_GANG_SECRET" in ended[1].stderr
    assert ended[0].returncode == 1 and "node 1 (not joined, ranks 2-3) never joined within 10 s" in ended[0].stderr
    assert not any("NODE_RANK" in e.stdout for e in ended)


@pytest.mark.timeout(120)
def test_only_a_run_across_nodes_listens_beyond_loopback_and_only_on_the_master_address() -> None:
    """One machine: levers9 run listens on loopback alone. Across nodes: on --master-addr alone (never every address),
    at --master-port and the ranks' store of each attempt."""
    script = str(REPO / "tests" / "scripts" / "launcher_ports.py")
    (one,) = launch_nodes(lambda i: [*LEVERS9, "--nproc-per-node", "2", script], lambda i: {}, nodes=1)
    port = free_port()
    across = launch_nodes(lambda i: [*_static(LEVERS9, port)(i), script], lambda i: SECRET)
    seen = []
    for ended in (one, across[0]):
        assert ended.returncode == 0, ended.stderr[-3000:]
        (line,) = [line for line in ended.stdout.splitlines() if line.startswith("LISTENS ")]
        seen.append(json.loads(line.partition(" ")[2]))
    alone, node0 = seen
    assert alone and all(address.startswith("127.0.0.1:") for address in alone), alone
    assert f"127.0.0.1:{port}" in node0 and all(address.startswith("127.0.0.1:") for address in node0), node0


# ---- two hosts of their own addresses: two network namespaces joined by a cable (a veth pair) ------------------------


@dataclasses.dataclass(frozen=True)
class Host:
    """A network namespace standing for a machine: the process that holds it, its one interface and that address."""

    holder: subprocess.Popen[bytes]
    interface: str
    address: str

    def run(self, command: list[str]) -> list[str]:
        """`command` as it runs on this host (nsenter execs it: the pid and process group are its own)."""
        return ["nsenter", f"--net=/proc/{self.holder.pid}/ns/net", *command]


def _run_checked(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"{' '.join(command)}: {done.stderr}"


@pytest.fixture
def two_hosts() -> Iterator[list[Host]]:
    """Two network namespaces, each with loopback and one end of a veth pair (10.231.0.1 and .2): as far as a launcher
    can tell, two machines on one network, neither reaching the other's loopback. Each is held by a process that
    reads its stdin (`unshare --net`), so it ends with the test, or with pytest; no named namespace and no mount is
    left behind. Needs root, `unshare` and `ip` (CI has them); elsewhere the tests say why they cannot run."""
    if os.geteuid() != 0:
        pytest.skip("two network namespaces need root (`unshare --net`); CI runs as root")
    tag = f"l9{os.getpid() % 100000}"
    holders: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(2):
            holders.append(subprocess.Popen(["unshare", "--net", "sh", "-c", "read _"], stdin=subprocess.PIPE,
                                            stderr=subprocess.PIPE))  # fmt: skip
        ours = os.readlink("/proc/self/ns/net")
        for holder in holders:  # unshare has made the namespace once the holder's link names another
            while os.readlink(f"/proc/{holder.pid}/ns/net") == ours:
                if holder.poll() is not None:
                    pytest.skip(f"`unshare --net` failed on this machine: {holder.stderr.read().decode().strip()}")  # type: ignore[union-attr]
                time.sleep(0.01)
        hosts = [Host(holders[0], f"{tag}va", "10.231.0.1"), Host(holders[1], f"{tag}vb", "10.231.0.2")]
        _run_checked(["ip", "link", "add", hosts[0].interface, "type", "veth", "peer", "name", hosts[1].interface])
        for host in hosts:
            _run_checked(["ip", "link", "set", host.interface, "netns", str(host.holder.pid)])
            _run_checked(host.run(["ip", "addr", "add", f"{host.address}/24", "dev", host.interface]))
            _run_checked(host.run(["ip", "link", "set", "lo", "up"]))
            _run_checked(host.run(["ip", "link", "set", host.interface, "up"]))
        yield hosts
    finally:
        for holder in holders:  # the namespaces end with their holders, and the veth pair with them
            holder.stdin.close()  # type: ignore[union-attr]
            holder.wait(timeout=30)


def _static_on(hosts: list[Host], launcher: list[str], port: int, *extra: str) -> Callable[[int], list[str]]:
    """Node i's launcher on hosts[i], node 0's address as the master address."""
    return lambda i: hosts[i].run([*launcher, "--nnodes", "2", "--node-rank", str(i), "--master-addr", hosts[0].address,
                                   "--master-port", str(port), "--nproc-per-node", "2", *extra])  # fmt: skip


@pytest.mark.timeout(420)
def test_two_hosts_of_their_own_addresses_give_torchruns_world(two_hosts: list[Host]) -> None:
    """The static form across two namespaces, side by side with torchrun's two launchers. torchrun's ranks are told
    their interface (GLOO_SOCKET_IFNAME), as its users on a machine of several interfaces do: its gloo takes the
    host name's address, here loopback's. levers9 run's find it from the address they reach node 0 on."""
    ours = launch_nodes(lambda i: [*_static_on(two_hosts, LEVERS9, 29500)(i), SCRIPT], lambda i: SECRET)
    theirs = launch_nodes(lambda i: [*_static_on(two_hosts, TORCHRUN, 29500)(i), SCRIPT],
                          lambda i: {"GLOO_SOCKET_IFNAME": two_hosts[i].interface})  # fmt: skip
    assert [e.returncode for e in theirs] == [0, 0], theirs[0].stderr[-2000:] + theirs[1].stderr[-2000:]
    assert [e.returncode for e in ours] == [0, 0], ours[0].stderr[-2000:] + ours[1].stderr[-2000:]
    mine, torchruns = ranks_seen(ours), ranks_seen(theirs)
    assert sorted(mine) == sorted(torchruns) == [0, 1, 2, 3]
    assert "NODE_RANK" in ours[0].stdout and "NODE_RANK" not in ours[1].stdout  # every rank's output on node 0
    for rank in range(4):
        for name, value in torchruns[rank].items():
            if name not in {"MASTER_PORT", "TORCHELASTIC_RUN_ID"}:  # levers9 binds a fresh port per attempt
                assert mine[rank][name] == value, (rank, name, mine[rank][name], value)
    assert {(r["sum"], r["world"], r["MASTER_ADDR"]) for r in mine.values()} == {(10.0, 4, "10.231.0.1")}
    assert {r["GROUP_RANK"] for r in mine.values()} == {"0", "1"}


@pytest.mark.timeout(300)
def test_a_rank_raising_on_the_other_host_is_named_with_that_hosts_address(two_hosts: list[Host]) -> None:
    ours = launch_nodes(lambda i: [*_static_on(two_hosts, LEVERS9, 29500)(i), SCRIPT, "raise"], lambda i: SECRET)
    node0, node1 = ours
    assert node0.returncode == 1, node0.stderr[-3000:]
    assert re.search(r"levers9 run: rank 2 \(pid \d+\) on node 1 \(10\.231\.0\.2\) raised ValueError: rank 2 could "
                     r"not read its shard; every other rank of 4 on 2 nodes was stopped", node0.stderr), node0.stderr[-3000:]
    assert "Traceback from rank 2:" in node0.stderr
    assert node1.returncode == 1, node1.stderr[-3000:]
    assert "the run across 2 nodes failed; node 0 (10.231.0.1) printed the failing rank" in node1.stderr, node1.stderr
    assert abs(node0.at - node1.at) < 15, "one launcher outlived the other by more than a few seconds"


@pytest.mark.timeout(300)
def test_c10d_across_two_hosts_makes_the_host_of_the_endpoint_node_0(two_hosts: list[Host]) -> None:
    """The same c10d command on both hosts: only host 0 has the endpoint's address, so its launcher hosts and is node 0.
    levers9 alone here: torchrun's two c10d launchers, given the same command and each its GLOO_SOCKET_IFNAME, hung
    until killed in this setup (its ranks are handed the hosting agent's host name, which these namespaces, sharing
    the machine's /etc/hosts, resolve to loopback); on the loopback test above they run side by side."""
    c10d = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"{two_hosts[0].address}:29400", "--rdzv-id", "job7"]  # fmt: skip
    ours = launch_nodes(lambda i: two_hosts[i].run([*LEVERS9, *c10d, SCRIPT]), lambda i: SECRET)
    assert [e.returncode for e in ours] == [0, 0], ours[0].stderr[-2000:] + ours[1].stderr[-2000:]
    mine = ranks_seen(ours)
    assert sorted(mine) == [0, 1, 2, 3] and "NODE_RANK" not in ours[1].stdout
    assert {(r["sum"], r["world"], r["MASTER_ADDR"]) for r in mine.values()} == {(10.0, 4, "10.231.0.1")}
    assert [(mine[rank]["GROUP_RANK"], mine[rank]["LOCAL_RANK"]) for rank in range(4)] == [
        ("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]  # fmt: skip


# ---- the options and PET_* variables, parsed as torchrun parses them (no process started) ----------------------


@pytest.mark.fast
def test_every_torchrun_option_is_known_with_its_kind() -> None:
    from torch.distributed.run import get_args_parser

    read_from_pet = [a for a in get_args_parser()._actions if type(a).__name__ in ("env", "check_env")]
    theirs = {a.dest: type(a).__name__ == "check_env" for a in read_from_pet}
    assert run_cli.TORCHRUN_OPTIONS == theirs


def _ours(*argv: str) -> argparse.Namespace:
    return build_parser(["run", *argv]).parse_args(["run", *argv])


@pytest.mark.fast
@pytest.mark.parametrize("argv", [["train.py"], ["--node-rank", "0", "--max-restarts", "1", "train.py"]])
def test_pet_variables_are_read_as_torchrun_reads_them(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> None:
    from torch.distributed.run import get_args_parser

    pet = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "10.0.0.7",
           "PET_MASTER_PORT": "1234", "PET_MAX_RESTARTS": "3", "PET_RDZV_CONF": "join_timeout=9", "PET_MODULE": "0",
           "PET_NO_PYTHON": "0", "PET_STANDALONE": "0"}  # fmt: skip
    for name, value in pet.items():
        monkeypatch.setenv(name, value)
    theirs, ours = get_args_parser().parse_args(argv), _ours(*argv)
    for dest in ("nnodes", "nproc_per_node", "node_rank", "master_addr", "master_port", "max_restarts", "rdzv_conf",
                 "module", "no_python", "standalone"):  # fmt: skip
        assert str(getattr(ours, dest)) == str(getattr(theirs, dest)), dest
    assert str(ours.node_rank) == ("0" if "--node-rank" in argv else "1")  # a flag wins over its variable
    layout = torchrun_nodes.layout_of(ours)
    assert layout == torchrun_nodes.NodeLayout(2, int(str(ours.node_rank)), "10.0.0.7", 1234, "none", 9.0)


@pytest.mark.fast
@pytest.mark.parametrize(("pet", "needles"), [
    ({"PET_LOCAL_ADDR": "10.0.0.7"}, ["--local-addr 10.0.0.7", "Expected localhost or 127.0.0.1; drop it"]),
    ({"PET_STANDALONE": "yes"}, ["PET_STANDALONE='yes'", "expected 1 or 0"]),
    ({"PET_START_METHOD": "thread"}, ["PET_START_METHOD='thread'", "expected one of spawn, fork, forkserver"]),
    ({"PET_NNODES": "2"}, ["levers9 run across 2 nodes (--nnodes 2) needs LEVERS9_GANG_SECRET", "it is unset",
                           "in Kubernetes, from a Secret in the pod's env"]),
    ({"PET_NNODES": "2:1"}, ["--nnodes '2:1'", "1 <= MIN <= MAX"]),
    ({"PET_NNODES": "2", "PET_NODE_RANK": "2"}, ["--node-rank 2 with --nnodes 2; expected 0 to 1"]),
    ({"PET_NNODES": "2", "PET_RDZV_BACKEND": "etcd"}, ["--rdzv-backend etcd; expected static", "or c10d"]),
    ({"PET_NNODES": "2", "PET_RDZV_BACKEND": "c10d"}, ["no --rdzv-endpoint", "e.g. --rdzv-endpoint node0:29400"]),
    ({"PET_NNODES": "2", "PET_RDZV_CONF": "join_timeout=0"}, ["join_timeout=0; expected a positive number"]),
    ({"PET_NNODES": "2", "PET_STANDALONE": "1"}, ["--standalone with --nnodes 2", "Drop --standalone"]),
])  # fmt: skip
def test_what_cannot_run_across_nodes_is_refused_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], pet: dict[str, str], needles: list[str]
) -> None:
    monkeypatch.delenv("LEVERS9_GANG_SECRET", raising=False)
    for name, value in pet.items():
        monkeypatch.setenv(name, value)
    assert cli_main(["run", SCRIPT]) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, err


@pytest.mark.fast
def test_c10d_endpoints_and_ranges(caplog: pytest.LogCaptureFixture) -> None:
    layout = torchrun_nodes.layout_of(_ours("--nnodes", "1:3", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0",
                                            "--rdzv-conf", "is_host=0", "train.py"))  # fmt: skip
    assert layout == torchrun_nodes.NodeLayout(3, None, "node0", 29400, "none", 600.0, is_host=False)
    assert "waits for all 3 nodes and runs on exactly 3" in caplog.text
    assert torchrun_nodes.layout_of(_ours("--nnodes", "1", "train.py")) is None
    with pytest.raises(ConfigError, match="expected HOST:PORT"):
        torchrun_nodes.layout_of(_ours("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", ":29400", "x.py"))

