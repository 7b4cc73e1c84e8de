"""levers9's multi-node Ray path against Ray Train's TorchTrainer, side by side on one two-node Ray cluster.

    pip install "ray[train]"        # Ray Train's extra (pandas, pyarrow): for this script only
    nice -n 5 python benchmarks/bench_ray_train.py --repeats 3

One `ray.cluster_utils.Cluster` for the whole run: two nodes on this machine (127.0.0.2 and 127.0.0.3),
each with 1 CPU and 2 logical GPUs declared as levers9_RTXPro6000, and 1 s x 3 health checks, as
tests/test_ray_nodes.py sets it up. 4 gloo ranks on the CPU, 2 per node, for both tools:

    levers9     @job(gpu="RTXPro6000", gpu_count=4, backend="ray") whose body calls
                distributed.run(rank_fn, cfg): levers9 plans 2 nodes x 2 cards (one STRICT_SPREAD
                placement group), forks ranks 0-1 from the job's process and ranks 2-3 from its agent
                task on the other node.
    Ray Train   TorchTrainer(rank_fn, scaling_config=ScalingConfig(num_workers=4, use_gpu=False,
                resources_per_worker={"CPU": 0, "levers9_RTXPro6000": 1})): each node holds 2 of that
                resource, so the 4 workers land 2 per node, as levers9's ranks do (Ray Train v2, the
                default; it numbers workers node by node, so ranks 2-3 share the node without rank 0).

The same module-level `rank_fn` runs in both (imported by name from this file, as a user's function would
be); it reads its rank from torch.distributed (both tools join every rank into the default gloo group
before fn) and writes the time it entered fn, its pid and its node to a file. The figures, each from
times the ranks wrote or taken where the caller holds the result or the error:

    start      the call (`job.remote(cfg)`, `TorchTrainer(...).fit()`) to the last of the 4 ranks in fn
    whole run  the call to the caller holding the result, for a fn that does one all_reduce and returns
    raise      rank 3 (on the node without rank 0) raises ValueError 3 s after a first all_reduce (steady
               state: see the last paragraph) while the others wait for it in a second one: from the raise
               to the caller holding the exception. The rows after it say what that exception tells.
    kill       the same, but rank 3 SIGKILLs its own process: from the kill to the caller's error
    frozen     every process the tool runs for the job on rank 3's node (levers9: its agent and ranks 2-3;
               Ray Train: the worker actors of ranks 2-3) gets SIGSTOP 3 s after all ranks are idling in
               fn; Ray's raylet there keeps running. From the SIGSTOP to the caller's error, capped at
               --cap seconds (then SIGCONT and the ranks are let go; a tool that hit the cap is not tried
               again)
    restart    levers9: distributed.run(..., max_restarts=1, restart_delay=0) (the default delay is 1 s;
               bench_restart.py uses 0 too); Ray Train: RunConfig(failure_config=FailureConfig(max_failures=1)).
               Rank 3 SIGKILLs itself in the first attempt only: from the kill to the last rank of the
               second attempt back in fn

Both tools keep their other defaults, and those explain most of the gaps. Ray Train starts 4 new worker
actors (4 new interpreters importing ray and torch) for every fit() and every restart, where levers9 forks
its ranks from Ray worker processes that Ray reuses across tasks. Ray Train polls its workers every 2 s
(RAY_TRAIN_HEALTH_CHECK_INTERVAL_S); on a failure it first gives the workers' destroy_process_group up to
30 s (TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S), which ranks still waiting in a collective use up, then 5 s
more to stop; and it gives up on a hung worker only when a status poll of it has hung for
RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S (default 600 s), so its frozen row reads "> cap". levers9 declares
a node lost when its agent's heartbeat stops for 5 s.

Runs are interleaved scenario by scenario (the order of the tools alternating per round), and one untimed
start of each tool warms the cluster and the page cache first; the table gives the median (min-max) of
--repeats. After each run the script waits until every rank's process, Ray Train's controller actor and
every placement group is gone, so no run overlaps the previous one's teardown (one still there after a
few seconds is noted under the table and ended), and at the end it shuts the cluster down and reports
any process left behind.

Why 3 s of steady state before a failure: a Ray Train worker that died within about half a second of
Ray Train launching fn (while its controller still ran its start-up callbacks) failed the run with a
ControllerError instead of a WorkerGroupError, and Ray Train 2.60 then left the run's placement group in
place, holding the 4 cards, so every later job on the cluster waited for cards forever.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
NODES = ("127.0.0.2", "127.0.0.3")
TYPE = "RTXPro6000"
RESOURCE = f"levers9_{TYPE}"
SCENARIOS = ("start", "raise", "kill", "frozen", "restart")
TOOLS = ("levers9", "Ray Train")
SETTLE_S = 3.0  # rank 3 fails (or its node freezes) this long after every rank is in fn: in steady state
SETUP_S = 120.0  # the most a run may take to get every rank into fn before the watchdog lets the ranks go
POLL_S = 0.01


# ---- what every rank runs (the same function under both tools) ----------------------------------------


def node_of_this_process() -> str:
    """The --node-ip-address of the nearest Ray worker among this process's ancestors (itself included)."""
    pid = os.getpid()
    while pid > 1:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().decode(errors="replace").split("\0")
        for arg in args:
            if arg.startswith(("--node-ip-address=", "--node_ip_address=")):
                return arg.split("=", 1)[1]
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    return "?"


def collective(folder: Path) -> None:
    """An all_reduce of every rank; waited for by polling, so that the watchdog's `release` file lets a
    rank go whose peer never comes (a peer's death still raises here, from the wait)."""
    import torch
    import torch.distributed as td

    work = td.all_reduce(torch.ones(1), async_op=True)
    assert work is not None
    while not work.is_completed():
        if (folder / "release").exists():
            return
        time.sleep(POLL_S)
    work.wait()


def rank_fn(cfg: dict[str, Any]) -> int:
    """The training function: note the entry, join one collective, then fail on rank 3 as the scenario says."""
    import torch.distributed as td

    entered = time.time()
    folder = Path(cfg["folder"])
    rank = td.get_rank()
    attempt = 1 if (folder / "failed").exists() else 0
    (folder / f"entered-{attempt}-{rank}").write_text(
        f"{entered} {os.getpid()} {os.getppid()} {node_of_this_process()}"
    )
    collective(folder)  # every rank is up
    scenario = cfg["scenario"]
    if scenario == "frozen":
        (folder / f"parked-{rank}").write_text("parked")
        while not (folder / "release").exists():
            time.sleep(POLL_S)
        return rank
    if scenario in ("raise", "kill", "restart") and rank == 3 and attempt == 0:
        time.sleep(SETTLE_S)  # the others already wait for it in the collective below
        (folder / "failed").write_text(repr(time.time()))
        if scenario == "raise":
            raise ValueError(f"rank {rank} fails on purpose")
        os.kill(os.getpid(), signal.SIGKILL)
    collective(folder)  # the others wait here for rank 3
    return rank


# ---- the two callers -------------------------------------------------------------------------------------


def levers9_body(cfg: dict[str, Any]) -> Any:
    """The job's body: distributed.run on the job's 4 cards (2 nodes x 2)."""
    from levers9 import distributed

    return distributed.run(rank_fn, cfg, max_restarts=cfg["restarts"], restart_delay=0)


def call_levers9(cfg: dict[str, Any], root: Path) -> Any:
    """`@job(gpu=RTXPro6000, gpu_count=4)` on the connected Ray, with distributed.run inside."""
    from levers9.launch import job

    return job(gpu=TYPE, gpu_count=4, backend="ray", timeout=600)(levers9_body).remote(cfg)


def call_ray_train(cfg: dict[str, Any], root: Path) -> Any:
    """TorchTrainer with 4 CPU workers, each holding one levers9_RTXPro6000 (so 2 per node)."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        rank_fn,
        train_loop_config=cfg,
        scaling_config=ScalingConfig(
            num_workers=4, use_gpu=False, resources_per_worker={"CPU": 0, RESOURCE: 1}
        ),
        run_config=RunConfig(
            name=Path(cfg["folder"]).name,
            storage_path=str(root / "ray-train"),
            failure_config=FailureConfig(max_failures=cfg["restarts"]),
        ),
    )
    previous = signal.getsignal(signal.SIGINT)
    try:
        return trainer.fit()
    finally:  # fit() leaves its Ctrl-C handler in place, and that holds the controller actor's handle:
        signal.signal(signal.SIGINT, previous)  # the actor (a process) lives on until the handler goes


CALLERS: dict[str, Callable[[dict[str, Any], Path], Any]] = {
    "levers9": call_levers9,
    "Ray Train": call_ray_train,
}


# ---- one run ------------------------------------------------------------------------------------------


@dataclass
class Run:
    """What one run of one scenario under one tool gave."""

    seconds: float | None  # None: the caller got no error within the cap (or no figure could be taken)
    error: BaseException | None = None
    whole: float | None = None  # call to result, for the start scenario
    notes: list[str] = field(default_factory=list)


def entries(folder: Path, attempt: int) -> dict[int, tuple[float, int, int, str]]:
    """rank -> (time it entered fn, pid, parent pid, node) for one attempt."""
    found = {}
    for path in folder.glob(f"entered-{attempt}-*"):
        when, pid, ppid, node = path.read_text().split()
        found[int(path.name.rsplit("-", 1)[1])] = (float(when), int(pid), int(ppid), node)
    return found


def wait_for_files(paths: list[Path], done: threading.Event, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and not done.is_set():
        if all(p.exists() for p in paths):
            return True
        time.sleep(POLL_S)
    return False


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def run_once(tool: str, scenario: str, root: Path, number: int, cap: float) -> Run:
    """One run: the call in this thread, a side thread that freezes node 1 (frozen) and lets the ranks go
    if the caller has no answer in time (`release`); then wait until every rank's process is gone."""
    folder = root / "runs" / f"{tool.replace(' ', '-')}-{scenario}-{number}"
    folder.mkdir(parents=True)
    cfg = {"folder": str(folder), "scenario": scenario, "restarts": 1 if scenario == "restart" else 0}
    done = threading.Event()
    side: dict[str, Any] = {"frozen": [], "frozen_at": None, "capped": False, "interrupted": False}

    def watch() -> None:
        parked = [folder / f"parked-{rank}" for rank in range(4)]
        if scenario == "frozen" and wait_for_files(parked, done, SETUP_S) and not done.wait(SETTLE_S):
            ranks = entries(folder, 0)
            node = ranks[3][3]
            pids = [pid for _, pid, _, where in ranks.values() if where == node]
            if tool == "levers9":  # the ranks' parent there: levers9's agent, a Ray worker running its task
                pids += sorted({ppid for _, _, ppid, where in ranks.values() if where == node})
            side["frozen"] = pids
            signal_all(pids, signal.SIGSTOP)
            side["frozen_at"] = time.time()
            if not done.wait(cap):
                side["capped"] = True
        elif not done.wait(SETUP_S + cap):
            side["capped"] = True
        signal_all(side["frozen"], signal.SIGCONT)
        (folder / "release").write_text("go")
        for _ in range(3):  # no rank to let go (stuck before fn): Ctrl-C the caller (Ray Train: 3 times)
            if not side["capped"] or done.wait(15):
                break
            side["interrupted"] = True
            os.kill(os.getpid(), signal.SIGINT)

    watcher = threading.Thread(target=watch, daemon=True)
    called = time.time()
    watcher.start()
    error: BaseException | None = None
    try:
        CALLERS[tool](cfg, root)
    except BaseException as exc:  # KeyboardInterrupt or SystemExit (Ray Train's Ctrl-C) too, if ours
        if not isinstance(exc, Exception) and not side["interrupted"]:
            raise
        error = exc
    answered = time.time()
    done.set()
    watcher.join()
    run = Run(None, error)
    if side["capped"]:
        run.notes.append(f"no answer within the cap; the ranks were let go, then: {describe(error)}")
    elif scenario == "start":
        first = entries(folder, 0)
        if error is None and len(first) == 4:
            run.seconds = max(e[0] for e in first.values()) - called
            run.whole = answered - called
    elif scenario in ("raise", "kill"):
        if error is not None and (folder / "failed").exists():
            run.seconds = answered - float((folder / "failed").read_text())
    elif scenario == "frozen":
        if error is not None and side["frozen_at"] is not None:
            run.seconds = answered - side["frozen_at"]
    elif scenario == "restart":
        back = entries(folder, 1)
        if error is None and len(back) == 4:
            run.seconds = max(e[0] for e in back.values()) - float((folder / "failed").read_text())
    if run.seconds is None and not side["capped"]:
        run.notes.append(f"no figure: {describe(error)}")
    check_nodes(folder, run)
    wait_gone(folder, run)
    if tool == "Ray Train":
        controllers_gone(root, run)
    placement_groups_gone(run)
    return run


def check_nodes(folder: Path, run: Run) -> None:
    """Note it if the ranks were not 2 per node with rank 3 away from rank 0."""
    ranks = entries(folder, 0)
    if len(ranks) == 4:
        nodes = [ranks[r][3] for r in range(4)]
        if nodes[0] != nodes[1] or nodes[2] != nodes[3] or nodes[0] == nodes[3]:
            run.notes.append(f"ranks 0-3 ran on {nodes}, not 2 per node")


def wait_gone(folder: Path, run: Run, within: float = 30.0) -> None:
    """Wait until every process that ran a rank (and levers9's agent) is gone; note any that outlives `within`."""
    pids = {e[1] for attempt in (0, 1) for e in entries(folder, attempt).values()}
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = sorted(p for p in pids if alive(p))
    if left:
        run.notes.append(f"rank processes {left} still alive {within:.0f} s after the call ended")


def title(pid: int) -> str:
    """The command line of pid, as ps shows it (Ray's workers set theirs to ray::<actor class>)."""
    with contextlib.suppress(OSError):
        return (
            Path(f"/proc/{pid}/cmdline")
            .read_bytes()
            .replace(b"\0", b" ")
            .decode(errors="replace")
            .strip()[:80]
        )
    return "?"


def controllers_gone(root: Path, run: Run, within: float = 15.0) -> None:
    """Wait until Ray Train's controller actor of the run is gone; note (and end) one that outlives `within`."""
    deadline = time.monotonic() + within
    while processes_under(root, "ray::TrainController") and time.monotonic() < deadline:
        time.sleep(0.1)
    left = processes_under(root, "ray::TrainController")
    if left:
        run.notes.append(
            f"Ray Train's controller (pid {left}) still alive {within:.0f} s after fit() returned"
        )
        signal_all(left, signal.SIGTERM)


def placement_groups_gone(run: Run, within: float = 10.0) -> None:
    """Wait until no placement group holds cards; note (and remove) one that outlives `within`: it would
    keep every later job of either tool waiting for its cards."""
    import ray
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    deadline = time.monotonic() + within
    while True:
        left = [pg for pg, info in placement_group_table().items() if info["state"] != "REMOVED"]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for pg in left:
        run.notes.append(f"placement group {pg[:8]} still held {within:.0f} s after the call ended (removed)")
        remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg)))


def describe(error: BaseException | None) -> str:
    if error is None:
        return "no error"
    return f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"


def error_text(error: BaseException) -> str:
    """Everything the caller can read off the exception: its message, notes, and its traceback."""
    return "".join(traceback.format_exception(error))


def named(error: BaseException | None, scenario: str) -> dict[str, str]:
    """How well the caller's exception names rank 3's failure."""
    if error is None:
        return {}
    text = error_text(error)
    rank_named = "rank 3" in text.lower() or "rank=3" in text.lower() or "world_rank=3" in text.lower()
    facts = {"type": type(error).__name__, "names rank 3": "yes" if rank_named else "no"}
    if scenario == "raise":
        facts["except ValueError catches it"] = "yes" if isinstance(error, ValueError) else "no"
        facts["rank 3's traceback (the raise line)"] = (
            "yes" if 'raise ValueError(f"rank {rank}' in text else "no"
        )
    if scenario == "kill":
        facts["says SIGKILL"] = "yes" if "SIGKILL" in text or "signal 9" in text.lower() else "no"
    return facts


# ---- the cluster ------------------------------------------------------------------------------------------


def start_cluster(root: Path) -> Any:
    """Two Ray nodes as in tests/test_ray_nodes.py's fixture, Ray's files under root; the driver connected."""
    import ray
    from ray.cluster_utils import Cluster

    saved = {k: v for k, v in os.environ.items() if k.startswith("LEVERS9_") or k in ("TMPDIR", "PYTHONPATH")}
    for key in saved:  # Ray's processes inherit this environment: no LEVERS9_* settings, scratch under root
        del os.environ[key]
    os.environ["TMPDIR"] = str(root)
    # every Ray worker (Ray Train's actors, levers9's tasks) imports rank_fn from this file by name
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), saved.get("PYTHONPATH")) if p)
    node_args = dict(num_cpus=1, num_gpus=2, resources={RESOURCE: 2}, object_store_memory=100 * 2**20)
    made = None
    try:
        made = Cluster(initialize_head=True, head_node_args=dict(
            node_ip_address=NODES[0], include_dashboard=False,
            _system_config={"health_check_period_ms": 1000, "health_check_failure_threshold": 3}, **node_args))  # fmt: skip
        made.add_node(node_ip_address=NODES[1], **node_args)
        made.wait_for_nodes()
        ray.init(address=made.address, _node_ip_address=NODES[0], log_to_driver=False)
    except BaseException:
        if made is not None:
            made.shutdown()
        raise
    finally:
        os.environ.pop("TMPDIR", None)
        os.environ.pop("PYTHONPATH", None)
        os.environ.update(saved)
    return made


def processes_under(root: Path, title: str = "") -> list[int]:
    """Pids of live processes whose command line or environment names root: every Ray process (started
    with TMPDIR=root; Ray's workers rename themselves ray::..., their environment keeps it) and every rank;
    only those whose command line starts with `title`, if given."""
    needle = str(root).encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            with contextlib.suppress(OSError):
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
                seen = cmdline + Path(f"/proc/{entry}/environ").read_bytes()
                if needle in seen and cmdline.startswith(title.encode()) and alive(int(entry)):
                    found.append(int(entry))
    return found


# ---- the table ---------------------------------------------------------------------------------------------


def seconds(run: Run) -> float | None:
    return run.seconds


def whole(run: Run) -> float | None:
    return run.whole


def cell(runs: list[Run], cap: float, pick: Callable[[Run], float | None] = seconds) -> str:
    values = [v for v in map(pick, runs) if v is not None]
    if not runs:
        return "-"
    if not values:
        if any("no answer within the cap" in n for r in runs for n in r.notes):
            return f"> {cap:.0f} s (no error; {len(runs)} {'try' if len(runs) == 1 else 'tries'})"
        return "not measurable: " + "; ".join(n for r in runs for n in r.notes)[:200]
    text = f"{statistics.median(values):.2f} s"
    if len(values) > 1:
        text += f" ({min(values):.2f}-{max(values):.2f})"
    if len(values) < len(runs):
        text += f", {len(runs) - len(values)} of {len(runs)} without a figure"
    return text


def ratio(a: list[Run], b: list[Run], pick: Callable[[Run], float | None] = seconds) -> str:
    left = [v for v in map(pick, a) if v is not None]
    right = [v for v in map(pick, b) if v is not None]
    if left and right:
        return f"{statistics.median(right) / statistics.median(left):.1f}x"
    if left and b:
        return "Ray Train: no figure"
    return "-"


def table(results: dict[tuple[str, str], list[Run]], cap: float, repeats: int) -> str:
    """The markdown table: one row per figure, then what each tool's exception says."""
    import ray

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [f"4 gloo ranks as 2 nodes x 2 on one 2-node Ray cluster on this machine ({os.cpu_count()} CPUs, load "
             f"average {load} at the end); median (min-max) of {repeats}; ray {ray.__version__}, "
             f"python {sys.version.split()[0]}",  # fmt: skip
             "", "| scenario | levers9 | Ray Train TorchTrainer | ratio (Ray Train / levers9) |", "| --- | --- | --- | --- |"]  # fmt: skip
    labels = {"start": "start: call to every rank in fn", "raise": "raise on rank 3: raise to the caller's exception",
              "kill": "rank 3 SIGKILLed: kill to the caller's error",
              "frozen": "node 2 frozen (SIGSTOP): stop to the caller's error",
              "restart": "restart (max 1): rank 3's death to every rank back in fn"}  # fmt: skip
    for scenario in SCENARIOS:
        ours, theirs = results.get(("levers9", scenario), []), results.get(("Ray Train", scenario), [])
        if not ours and not theirs:
            continue
        lines.append(
            f"| {labels[scenario]} | {cell(ours, cap)} | {cell(theirs, cap)} | {ratio(ours, theirs)} |"
        )
        if scenario == "start":
            lines.append(f"| whole run: call to result | {cell(ours, cap, whole)} | {cell(theirs, cap, whole)} | "
                         f"{ratio(ours, theirs, whole)} |")  # fmt: skip
        if scenario in ("raise", "kill"):
            facts = {tool: named(next((r.error for r in results.get((tool, scenario), []) if r.error), None), scenario)
                     for tool in TOOLS}  # fmt: skip
            for key in dict.fromkeys([*facts["levers9"], *facts["Ray Train"]]):
                lines.append(f"| {scenario}: {key} | {facts['levers9'].get(key, '-')} | "
                             f"{facts['Ray Train'].get(key, '-')} | |")  # fmt: skip
    notes = [
        f"- {tool}, {scenario}: {n}"
        for (tool, scenario), runs in results.items()
        for r in runs
        for n in r.notes
    ]
    if notes:
        lines += ["", "Notes:", *dict.fromkeys(notes)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--cap", type=float, default=90.0, help="seconds to wait for an error after the freeze"
    )
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="a comma-separated subset of " + ",".join(SCENARIOS))  # fmt: skip
    parser.add_argument("--tools", default=",".join(TOOLS), help="a comma-separated subset of " + ",".join(TOOLS))
    parser.add_argument(
        "--show-errors", action="store_true", help="print each failure scenario's exception text"
    )
    args = parser.parse_args()
    scenarios = [s for s in SCENARIOS if s in args.scenarios.split(",")]
    tools = [t for t in TOOLS if t in args.tools.split(",")]
    logging.getLogger("ray").setLevel(logging.WARNING)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # short: Ray's socket paths must fit 107 bytes
    root = Path(tempfile.mkdtemp(prefix="l9bench-", dir="/tmp"))
    cluster = None
    try:
        cluster = start_cluster(root)
        os.environ["LEVERS9_CONFIG_DIR"] = str(root / "config")  # levers9's settings for this run alone
        os.environ["LEVERS9_STATE_DIR"] = str(root / "state")
        (root / "config").mkdir()
        from levers9.launch.settings import update_settings

        update_settings(multi_gpu=True)
        for tool in tools:  # warm the cluster's worker pool and the page cache once, untimed
            run_once(tool, "start", root, -1, args.cap)
        results: dict[tuple[str, str], list[Run]] = {}
        for number in range(args.repeats):
            for scenario in scenarios:
                for tool in tools if number % 2 == 0 else tools[::-1]:
                    runs = results.setdefault((tool, scenario), [])
                    if any("no answer within the cap" in n for r in runs for n in r.notes):
                        continue  # capped once: a second try costs the cap again and says the same
                    run = run_once(tool, scenario, root, number, args.cap)
                    runs.append(run)
                    print(f"{scenario:8} {tool:10} {run.seconds if run.seconds is None else round(run.seconds, 2)}"
                          f"  {describe(run.error)}", flush=True)  # fmt: skip
                    if args.show_errors and run.error is not None and number == 0:
                        print(error_text(run.error)[-4000:], flush=True)
        print()
        print(table(results, args.cap, args.repeats))
    finally:
        import ray

        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        deadline = time.monotonic() + 15
        while processes_under(root) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = {pid: title(pid) for pid in processes_under(root)}
        print(f"\nprocesses left 15 s after the cluster's shutdown: {left if left else 'none'}")
        if left:  # Ray's to end, but it did not: end them so that the run leaves nothing behind
            signal_all(list(left), signal.SIGKILL)
            print("(ended with SIGKILL)")
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    # Run as the module bench_ray_train (on sys.path: this folder), not as __main__: both tools then pickle
    # rank_fn by reference, as they would a user's module-level function (cloudpickle ships a __main__
    # function by value, and newer cloudpickle, levers9's, blanks its file name, so tracebacks lose its lines).
    importlib.import_module(Path(__file__).stem).main()
