"""levers9 under a real SLURM 22.05: two nodes (two slurmd on this machine), 2 GRES cards each
(tests/slurm_cluster.py starts compat_tests/slurm_cluster.sh). Real srun and sbatch, never a mock.

The cards are device files SLURM hands out as CUDA_VISIBLE_DEVICES; the ranks run on gloo.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from levers9.cli import main as cli_main
from levers9.distributed import slurm_env
from levers9.errors import InfeasibleJobError, JobConfigError, JobCrashed, JobTimeout, WorkspacePolicyError
from levers9.launch import job, run_reader
from levers9.launch.settings import update_settings
from tests import jobfns, proc_util, slurm_cluster, slurmfns
from tests.test_faults_state import small_disk  # noqa: F401  (the fixture: a real small tmpfs)
from tests.timeouts import timed_out_once_started

pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("slurm")]  # one worker: the one cluster

ROOT = Path(__file__).resolve().parent.parent
RANKS = ROOT / "tests" / "scripts" / "slurm_ranks.py"


@pytest.fixture
def env(request: pytest.FixtureRequest) -> dict[str, str]:
    """This test's environment (no launcher variables) with the session cluster's SLURM_CONF."""
    conf = slurm_cluster.slurm_conf(request.config)
    return {**os.environ, "SLURM_CONF": conf, "PYTHONPATH": str(ROOT)}


def srun(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`srun ARGS`, its output as text; a hang fails the test at `timeout`."""
    return subprocess.run(["srun", *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def with_gang_secret(env: dict[str, str]) -> dict[str, str]:
    """`env` with the LEVERS9_GANG_SECRET a job script exports before `srun levers9 run` across nodes."""
    return {**env, "LEVERS9_GANG_SECRET": secrets.token_hex(16)}


def ranks_seen(out: str) -> list[dict[str, object]]:
    """The RANK reports of tests/scripts/slurm_ranks.py, sorted by rank. Each is read where it starts: ranks that
    share one pipe unprefixed (torchrun's) may write a report and another's line ending in between."""
    decoder = json.JSONDecoder()
    reports = [decoder.raw_decode(out, found.end() - 1)[0] for found in re.finditer(r"RANK \{", out)]
    return sorted(reports, key=lambda r: int(str(r["rank"])))


def test_srun_two_nodes_two_tasks_each(env: dict[str, str]) -> None:
    done = srun(env, "-N2", "--ntasks-per-node=2", sys.executable, str(RANKS))
    assert done.returncode == 0, done.stderr
    seen = ranks_seen(done.stdout)
    assert [(r["rank"], r["local_rank"], r["node_rank"], r["node"]) for r in seen] == [
        (0, 0, 0, "l9node1"), (1, 1, 0, "l9node1"), (2, 0, 1, "l9node2"), (3, 1, 1, "l9node2"),
    ]  # fmt: skip
    assert {(r["world_size"], r["local_world_size"], r["launcher"], r["sum"]) for r in seen} == {(4, 2, "slurm", 4.0)}
    assert done.stdout.count("VALUE 0") == 4  # rank 0's value on every rank


def test_srun_one_node_two_tasks(env: dict[str, str]) -> None:
    done = srun(env, "-N1", "-n2", sys.executable, str(RANKS))
    assert done.returncode == 0, done.stderr
    seen = ranks_seen(done.stdout)
    assert [(r["rank"], r["local_rank"], r["node_rank"], r["world_size"], r["sum"]) for r in seen] == [
        (0, 0, 0, 2, 2.0), (1, 1, 0, 2, 2.0),
    ]  # fmt: skip


def test_one_task_with_cards_starts_its_own_ranks(env: dict[str, str]) -> None:
    """`srun -n1` (an sbatch job of one task): distributed.run starts the ranks, as on a workstation."""
    done = srun(env, "-N1", "-n1", "--gres=gpu:2", sys.executable, str(RANKS), "2")
    assert done.returncode == 0, done.stderr
    seen = ranks_seen(done.stdout)
    assert [(r["rank"], r["world_size"], r["launcher"]) for r in seen] == [(0, 2, "levers9"), (1, 2, "levers9")]


def test_unresolvable_master_is_one_error_within_seconds(env: dict[str, str]) -> None:
    started = time.monotonic()
    done = srun({**env, "MASTER_ADDR": "no-such-node.invalid"}, "-N1", "-n2", sys.executable, str(RANKS), timeout=90)
    assert done.returncode != 0
    assert "The rendezvous host 'no-such-node.invalid' (from MASTER_ADDR) does not resolve" in done.stderr
    assert time.monotonic() - started < 60


def test_tasks_per_node_not_matching_cards_names_the_sbatch_line(env: dict[str, str]) -> None:
    done = srun(env, "-N2", "--ntasks-per-node=1", "--gres=gpu:2", sys.executable, str(RANKS), timeout=90)
    assert done.returncode != 0
    assert "1 card(s) would sit idle" in done.stderr
    assert "change `#SBATCH --ntasks-per-node=1` to `#SBATCH --ntasks-per-node=2`" in done.stderr


def test_job_script_without_srun_names_the_sbatch_line(env: dict[str, str], tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH -N1 --ntasks-per-node=2\n{sys.executable} {RANKS}\n")
    out = tmp_path / "job.out"
    done = subprocess.run(["sbatch", "--parsable", "-o", str(out), str(script)], env=env, capture_output=True, text=True,
                          timeout=60, cwd=tmp_path, check=True)  # fmt: skip
    job_id = done.stdout.strip().split(";")[0]

    def state() -> str:
        return subprocess.run(["squeue", "-h", "-j", job_id, "-t", "all", "-o", "%T"], env=env, capture_output=True,
                              text=True, timeout=60).stdout.strip()  # fmt: skip

    # the job's state, not `sbatch --wait`, which polls at 2 s and more (it took 10 s whatever the job took)
    assert wait_until(lambda: state() in ("FAILED", "COMPLETED"), 120), state()
    assert state() == "FAILED"
    text = out.read_text()
    assert "was not started by srun (no SLURM_STEP_ID)" in text
    assert f"`srun python {RANKS}`" in text and "`#SBATCH --ntasks-per-node=2`" in text


# ---- @job(backend="slurm") ------------------------------------------------------------------------


@pytest.fixture
def on_slurm(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs of this test go to the session's SLURM (its tasks import levers9 and tests/ from this checkout)."""
    monkeypatch.setenv("SLURM_CONF", env["SLURM_CONF"])
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    update_settings(multi_gpu=True)


def squeue(name: str, env: dict[str, str]) -> list[str]:
    """This test's jobs still known to SLURM in any state but completed: '<id> <state>' lines."""
    done = subprocess.run(["squeue", "-h", "-r", "-n", name, "-o", "%i %T"], env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    return [line for line in done.stdout.splitlines() if not line.endswith("COMPLETED")]


def wait_until(condition: Callable[[], bool], within: float) -> bool:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def early_signal_once(ready: Callable[[], bool], name: str, env: dict[str, str]) -> threading.Thread:
    """A started thread that sends job `name` SLURM's early signal (`scancel --signal=USR2`, as SLURM sends it) once
    `ready()` holds; join it after the job."""

    def signal_when_ready() -> None:
        assert wait_until(ready, 90)
        job_id = squeue(name, env)[0].split()[0]
        subprocess.run(["scancel", "--signal=USR2", job_id], env=env, check=True, timeout=60)

    helper = threading.Thread(target=signal_when_ready, daemon=True)
    helper.start()
    return helper


def test_remote_runs_one_job_on_a_node(on_slurm: None) -> None:
    value = job(slurmfns.where, gpu_count=1, backend="slurm").remote(7)
    assert value["x"] == 7 and value["node"] in ("l9node1", "l9node2")
    assert value["cards"] == "0"  # SLURM's GRES: one card, as CUDA_VISIBLE_DEVICES
    assert value["array"] is None


def test_map_is_one_job_array_with_a_concurrency_limit(on_slurm: None) -> None:
    results = job(slurmfns.where, gpu_count=1, backend="slurm", slurm={"max_running": 3}).map(range(12))
    values = list(results)
    assert [v["x"] for v in values] == list(range(12))
    assert len({v["array"] for v in values}) == 1 and values[0]["array"] is not None
    scripts = list((Path(os.environ["LEVERS9_STATE_DIR"]) / "runs" / str(results.run_id) / "slurm").glob("*submission.sh"))
    assert len(scripts) == 1 and "#SBATCH --array=0-11%3" in scripts[0].read_text()


def test_a_200_cell_map_is_one_job_array(on_slurm: None) -> None:
    """The issue's sweep: 200 CPU cells, one sbatch (one array of 200, at most 16 running), every value back in
    input order, from both nodes."""
    results = job(slurmfns.where, backend="slurm", slurm={"max_running": 16}).map(range(200))
    values = list(results)
    assert [v["x"] for v in values] == list(range(200))
    assert {v["array"] for v in values} == {values[0]["array"]} and values[0]["array"] is not None
    assert {v["node"] for v in values} == {"l9node1", "l9node2"}
    scripts = list((Path(os.environ["LEVERS9_STATE_DIR"]) / "runs" / str(results.run_id) / "slurm").glob("*submission.sh"))
    assert len(scripts) == 1 and "#SBATCH --array=0-199%16" in scripts[0].read_text()


def test_more_cards_than_a_node_is_one_training_across_nodes(on_slurm: None) -> None:
    value = job(slurmfns.train, gpu_count=4, backend="slurm").remote()
    ranks = value["ranks"]
    assert [(r["rank"], r["node_rank"], r["node"], r["world"], r["sum"]) for r in ranks] == [
        (0, 0, "l9node1", 4, 6.0), (1, 0, "l9node1", 4, 6.0), (2, 1, "l9node2", 4, 6.0), (3, 1, "l9node2", 4, 6.0),
    ]  # fmt: skip


def test_a_training_across_nodes_meets_where_rank_0_bound_not_where_anyone_can_derive(
    on_slurm: None, env: dict[str, str]
) -> None:
    """Another process listens first, on every address, on the port SLURM's job id gives (10000 + id % 20000, what
    the ranks met on before) for each of the next job ids: the training runs, on a port rank 0 bound itself, and no
    rank connects to the squatter."""
    probe = subprocess.run(["sbatch", "--parsable", "--output=/dev/null", "--wrap", "true"], env=env,
                           capture_output=True, text=True, check=True, timeout=60)  # fmt: skip
    last_id = int(probe.stdout.strip().split(";")[0])
    next_ids = range(last_id + 1, last_id + 6)
    derived = {slurm_env.master_port({"SLURM_JOB_ID": str(job_id)}) for job_id in next_ids}
    squatters = []
    try:
        for port in derived:
            squatter = socket.socket()
            squatters.append(squatter)
            squatter.bind(("0.0.0.0", port))
            squatter.listen(16)
            squatter.setblocking(False)
        ranks = job(slurmfns.train, gpu_count=4, backend="slurm").remote()["ranks"]
        for squatter in squatters:
            with pytest.raises(BlockingIOError):
                squatter.accept()  # nothing connected
    finally:
        for squatter in squatters:
            squatter.close()
    assert [(r["rank"], r["world"], r["sum"]) for r in ranks] == [(0, 4, 6.0), (1, 4, 6.0), (2, 4, 6.0), (3, 4, 6.0)]
    ports = {r["master_port"] for r in ranks}
    assert len(ports) == 1 and int(str(ports.pop())) not in derived


def test_a_job_of_cards_on_one_node_starts_a_rank_per_card(on_slurm: None) -> None:
    ranks = job(slurmfns.train, gpu_count=2, backend="slurm").remote()["ranks"]
    assert [(r["rank"], r["world"], r["node_rank"]) for r in ranks] == [(0, 2, 0), (1, 2, 0)]
    assert ranks[0]["node"] == ranks[1]["node"]


def test_a_rank_on_the_second_node_raising_is_named(on_slurm: None) -> None:
    with pytest.raises(ValueError, match="rank 3 failed on purpose") as caught:
        job(slurmfns.fail_on_rank, gpu_count=4, backend="slurm").remote(3)
    note = caught.value.__notes__[-1]
    assert "on l9node2 as rank 3 of l9node[1-2]" in note  # srun started rank 3 there: SLURM is the launcher
    assert any("raise ValueError" in n for n in caught.value.__notes__)  # the rank's traceback


def test_a_rank_killed_by_a_signal_is_named(on_slurm: None) -> None:
    with pytest.raises(JobCrashed, match=r"rank\(s\) 3 on l9node2 killed by SIGKILL \(srun: Killed\)") as caught:
        job(slurmfns.fail_on_rank, gpu_count=4, backend="slurm").remote(3, "kill")
    assert "memory" not in str(caught.value).split("Last output")[0]  # neither SLURM nor the kernel said so


def _scancel_once_started(started: Path, env: dict[str, str]) -> threading.Thread:
    """A thread that cancels the SLURM job that wrote `started` (slurmfns.gated_square), as a user's scancel does."""

    def cancel() -> None:
        assert wait_until(started.exists, 90), "the job never started"
        subprocess.run(["scancel", started.read_text().split()[1]], env=env, check=True, timeout=60)

    thread = threading.Thread(target=cancel)
    thread.start()
    return thread


# SLURM 24 and later add the signal to a plain scancel's line: '... CANCELLED AT <time> DUE to SIGNAL Terminated ***'
CANCELLED_BY_SLURM = (r"was cancelled in SLURM \(scancel: .*not by levers9\) at \S+ \(SLURM: \*\*\* JOB \d+ ON l9node\d CANCELLED "
                      r"AT \S+( DUE to SIGNAL \w+)? \*\*\*\)")


def test_a_job_cancelled_in_slurm_is_named_cancelled_not_out_of_memory(
    on_slurm: None, env: dict[str, str], tmp_path: Path
) -> None:
    """An scancel of a one-task job, then of one task of an array, named from SLURM's own CANCELLED line (it was
    'killed by SIGTERM ... most often the out-of-memory killer')."""
    fn = job(slurmfns.gated_square, backend="slurm", name="l9-scancel")
    canceller = _scancel_once_started(tmp_path / "started-3", env)
    with pytest.raises(JobCrashed, match=CANCELLED_BY_SLURM) as caught:
        fn.remote(3, str(tmp_path))
    canceller.join()
    assert "memory" not in str(caught.value).split("Last output")[0]
    canceller = _scancel_once_started(tmp_path / "started-4", env)
    results = fn.map([(4, str(tmp_path)), (5, str(tmp_path))], return_exceptions=True, progress=False)
    cancelled = next(results)  # cell 4, once SLURM ended its task of the array
    canceller.join()
    (tmp_path / "gate").write_text("go")
    assert next(results) == 25
    assert isinstance(cancelled, JobCrashed) and re.search(CANCELLED_BY_SLURM, str(cancelled)), cancelled
    assert "memory" not in str(cancelled).split("Last output")[0]


def _node_state(node: str, env: dict[str, str]) -> str:
    """`node`'s state in sinfo's short words (idle, down*, comp, ...), after asking SLURM to resume it."""
    subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], env=env, capture_output=True, timeout=60)
    state = subprocess.run(["sinfo", "-h", "-n", node, "-o", "%t"], env=env, capture_output=True, text=True, timeout=60)
    return " ".join(sorted(set(state.stdout.split())))  # one line per partition the node is in


def test_a_lost_node_is_named_with_its_ranks(on_slurm: None, env: dict[str, str], tmp_path: Path) -> None:
    """A training across both nodes, l9node2 marked failed while every rank computes: the caller hears which node
    was lost and which ranks ran there, from srun's and SLURM's own lines (kind LOST, not a bare gloo error)."""

    def fail_node() -> None:
        assert wait_until(lambda: all((tmp_path / f"started-{r}").exists() for r in range(4)), 120)
        subprocess.run(["scontrol", "update", "NodeName=l9node2", "State=DOWN", "Reason=levers9-test"], env=env,
                       check=True, timeout=60)  # fmt: skip

    failer = threading.Thread(target=fail_node)
    failer.start()
    try:
        with pytest.raises(JobCrashed, match=r"lost its node l9node2 \(its rank\(s\) 2-3\), which SLURM marked failed "
                                             r"\(srun: Node failure on l9node2\)") as caught:  # fmt: skip
            job(slurmfns.ranks_compute_until_gate, gpu_count=4, backend="slurm", name="l9-lost-node").remote(str(tmp_path))
        assert caught.value.kind == "lost" and "DUE TO NODE FAILURE" in str(caught.value).split("Last output")[0]
    finally:
        failer.join()
        assert wait_until(lambda: _node_state("l9node2", env) == "idle", 120), _node_state("l9node2", env)


def test_a_job_past_its_slurm_time_limit_is_named_timed_out(on_slurm: None, env: dict[str, str], tmp_path: Path) -> None:
    """SLURM's own time limit (a 1-minute --time, no timeout= of levers9's) ends a computing job: a JobTimeout in
    SLURM's words, not a crash or a guess at memory. Takes about a minute."""
    fn = job(slurmfns.gated_square, backend="slurm", name="l9-time-limit", slurm={"sbatch": "--time=1"})
    with pytest.raises(JobTimeout, match=r"reached its SLURM time limit \(SLURM: \*\*\* JOB \d+ ON l9node\d CANCELLED AT "
                                         r"\S+ DUE TO TIME LIMIT \*\*\*\)") as caught:  # fmt: skip
        fn.remote(6, str(tmp_path))
    assert "memory" not in str(caught.value).split("Last output")[0]


def test_a_preempted_job_is_named_preempted(on_slurm: None, env: dict[str, str], tmp_path: Path) -> None:
    """A job of the cluster's higher-tier partition (l9urgent, compat_tests/slurm_cluster.sh) needs the node a
    computing job holds whole: SLURM cancels it for preemption, and the caller hears that (kind LOST: the job did
    nothing wrong), not 'killed by SIGTERM ... most often the out-of-memory killer'."""
    urgent: list[str] = []

    def preempt() -> None:
        assert wait_until((tmp_path / "started-7").exists, 90), "the job never started"
        job_id = (tmp_path / "started-7").read_text().split()[1]
        node = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%N"], env=env, capture_output=True, text=True,
                              timeout=60).stdout.strip()  # fmt: skip
        submitted = subprocess.run(["sbatch", "--parsable", "-p", "l9urgent", "-w", node, "-c", "8", "-J", "l9-urgent",
                                    "--output=/dev/null", "--wrap", "true"], env=env, capture_output=True, text=True,
                                   timeout=60, check=True)  # fmt: skip
        urgent.append(submitted.stdout.strip())

    preempter = threading.Thread(target=preempt)
    preempter.start()
    try:
        fn = job(slurmfns.gated_square, backend="slurm", cpu=8, name="l9-preempted")  # the whole node's cores
        with pytest.raises(JobCrashed, match=r"was preempted by SLURM \(a job of higher priority took its node\) "
                                             r"\(SLURM: \*\*\* JOB \d+ ON l9node\d CANCELLED AT \S+ DUE TO "
                                             r"PREEMPTION \*\*\*\)") as caught:  # fmt: skip
            fn.remote(7, str(tmp_path))
        assert caught.value.kind == "lost" and "memory" not in str(caught.value).split("Last output")[0]
    finally:
        preempter.join()
        assert wait_until(lambda: not squeue("l9-urgent", env), 60), squeue("l9-urgent", env)


def test_a_full_run_folder_is_named_not_a_failed_job(
    on_slurm: None, env: dict[str, str], request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 6 MB file system as the state folder and a job that prints 8 MB: the caller hears that the run folder is
    full and what to change (it was 'ended (FAILED) before returning', an empty tail and a 0-byte .save_tmp
    left); the next job is not submitted at all."""
    state = request.getfixturevalue("small_disk")("6m") / "state"
    monkeypatch.setenv("LEVERS9_STATE_DIR", str(state))
    name = f"l9-full-{secrets.token_hex(3)}"
    fn = job(slurmfns.print_megabytes, backend="slurm", name=name, stream_output=False)
    with pytest.raises(JobCrashed, match=r"without a result it could write, its run folder \S+ is full \(No space left on "
                                         r"device\).*LEVERS9_STATE_DIR=" + re.escape(str(state))):  # fmt: skip
        fn.remote(8)
    assert not list(state.rglob("*.save_tmp"))  # nothing half-written left behind
    with pytest.raises(JobConfigError, match=r"is full \(No space left on device\): SLURM jobs write their output and "
                                             r"result there \(under slurm/\), so nothing was submitted"):  # fmt: skip
        fn.remote(1)
    known = subprocess.run(["squeue", "-h", "-r", "-t", "all", "-n", name, "-o", "%i"], env=env, capture_output=True,
                           text=True, timeout=60)  # fmt: skip
    assert len(known.stdout.split()) == 1, known.stdout  # the first job only


def test_a_partition_that_does_not_exist_is_named_with_those_that_do(on_slurm: None, env: dict[str, str]) -> None:
    """Before anything is submitted (sbatch's own word, as submitit passes it on: 'invalid partition specified';
    with cards it used to be 'its cards are declared without a type')."""
    for cards in (0, 2):
        fn = job(slurmfns.square, gpu_count=cards, backend="slurm", name="l9-nosuch", slurm={"partition": "nosuch"})
        with pytest.raises(JobConfigError, match=r"no partition 'nosuch'; its partitions are: l9, l9urgent \(sinfo\)"):
            fn.remote(3)
    assert squeue("l9-nosuch", env) == []


def test_an_account_or_qos_the_user_may_not_charge_is_named_with_those_it_may(on_slurm: None, env: dict[str, str]) -> None:
    """The cluster enforces associations and QOS (compat_tests/slurm_cluster.sh): an account that does not exist, one
    that exists without this user, and a QOS that does not exist are each refused before anything is submitted, with
    what the user may charge (sbatch's own word: 'Invalid account or account/partition combination specified'); an
    allowed pair runs, charged as asked."""
    refused = [
        ({"account": "nosuch"}, r"lets user root charge no account 'nosuch'; the accounts root may use are: l9lab, "
                                r"l9spare, root \(sacctmgr show assoc where user=root\)"),
        ({"account": "l9other"}, r"charge no account 'l9other'; the accounts root may use are: l9lab, l9spare, root"),
        ({"account": "l9spare", "qos": "nosuch"}, r"lets user root use no QOS 'nosuch' under account 'l9spare'; the QOS "
                                                  r"allowed are: l9fast, normal"),
    ]  # fmt: skip
    name = f"l9-charge-{secrets.token_hex(3)}"  # the accounting database outlives the cluster's runs
    for options, words in refused:
        with pytest.raises(JobConfigError, match=words):
            job(slurmfns.square, backend="slurm", name=name, slurm=options).remote(3)
    assert squeue(name, env) == []
    fn = job(slurmfns.where, backend="slurm", name=name, slurm={"account": "l9spare", "qos": "l9fast"})
    assert fn.remote(4)["x"] == 4

    def charged() -> list[str]:  # slurmctld sends the job's record to slurmdbd on its own time
        listed = subprocess.run(["sacct", "-nP", "-X", f"--name={name}", "-o", "account,qos"], env=env,
                                capture_output=True, text=True, timeout=60)  # fmt: skip
        return listed.stdout.split()

    assert wait_until(lambda: charged() == ["l9spare|l9fast"], 60), charged()


def test_more_cards_than_the_cluster_is_refused_before_submitting(on_slurm: None) -> None:
    with pytest.raises(InfeasibleJobError, match=r"l9node1 \(2 GPU\(s\)"):
        job(slurmfns.square, gpu_count=6, backend="slurm").remote(1)


def test_a_gpu_type_is_asked_as_gres_of_that_type(on_slurm: None) -> None:
    """The cluster's cards are GRES type h100 (compat_tests/slurm_cluster.sh): gpu="H100" is --gres=gpu:h100:1."""
    results = job(slurmfns.where, gpu="H100", gpu_count=1, backend="slurm").map([5])
    assert [v["x"] for v in results] == [5]
    scripts = list((Path(os.environ["LEVERS9_STATE_DIR"]) / "runs" / str(results.run_id) / "slurm").glob("*submission.sh"))
    assert "#SBATCH --gres=gpu:h100:1" in scripts[0].read_text()


def test_a_gpu_type_the_cluster_lacks_is_refused_before_submitting(on_slurm: None, env: dict[str, str]) -> None:
    with pytest.raises(InfeasibleJobError, match=r"gpu='A100-80'.*its cards are h100 \(H100\)"):
        job(slurmfns.square, gpu="A100-80", gpu_count=1, backend="slurm", name="l9-type").remote(1)
    assert squeue("l9-type", env) == []


def test_timeout_cancels_the_job(on_slurm: None, env: dict[str, str], tmp_path: Path) -> None:
    marker = tmp_path / "started"
    timed_out_once_started(
        lambda timeout: job(slurmfns.sleep_then, backend="slurm", timeout=timeout, name="l9-timeout").remote(120, str(marker)),
        started=marker.exists, match=r"exceeded timeout={timeout}s .* was cancelled",
    )  # fmt: skip
    pid = int(marker.read_text().split()[0])
    assert wait_until(lambda: not squeue("l9-timeout", env) and not proc_util.alive(pid), 30), squeue("l9-timeout", env)


def test_max_restarts_restarts_a_training_across_nodes(on_slurm: None, tmp_path: Path) -> None:
    """Rank 3 (on l9node2) is killed in attempt 1; every rank starts again (srun starts them: a new job) and resumes
    from the checkpoint, each seeing restart_count() 1."""
    ranks = job(slurmfns.train_restarting, gpu_count=4, backend="slurm", max_restarts=1).remote(str(tmp_path))
    assert [(r["rank"], r["attempt"], r["sum"], r["resumed"], r["node"]) for r in ranks] == [
        (0, 2, 4.0, "step 5", "l9node1"), (1, 2, 4.0, "step 5", "l9node1"),
        (2, 2, 4.0, "step 5", "l9node2"), (3, 2, 4.0, "step 5", "l9node2"),
    ]  # fmt: skip


def test_a_cancel_gives_the_job_its_stop_grace(on_slurm: None, env: dict[str, str], tmp_path: Path) -> None:
    """timeout= stops the job as a cancel does: SIGTERM, the function's handler saves for 7 s (more than the
    cluster's KillWait of 5 s, after which SLURM's own cancel kills), the kill only after stop_grace."""
    timed_out_once_started(
        lambda timeout: job(slurmfns.save_on_sigterm, backend="slurm", timeout=timeout, stop_grace=30, name="l9-grace")
        .remote(str(tmp_path), 7),
        started=(tmp_path / "started").exists,
    )  # fmt: skip
    assert wait_until(lambda: not squeue("l9-grace", env), 60), squeue("l9-grace", env)
    assert (tmp_path / "term").exists(), "the job never got SIGTERM"
    assert (tmp_path / "saved").read_text() == "saved"
    reaper = f"{ROOT}/levers9/launch/slurm/reaper.py 30"  # the helper that kills after stop_grace=30
    assert wait_until(lambda: subprocess.run(["pgrep", "-f", reaper], capture_output=True).returncode == 1, 25), \
        "the helper that kills after stop_grace did not leave when the job ended"


def test_a_stopped_map_starts_none_of_its_queued_cells(on_slurm: None, env: dict[str, str], tmp_path: Path) -> None:
    """Eight cells on four cards, stopped with four running: the four queued array elements are cancelled at once.
    (They were left pending through the running cells' stop_grace, and started on the cards those freed.)"""
    results = job(jobfns.quick_or_slow, gpu_count=1, backend="slurm", stop_grace=10, name="l9-queued").map(
        [(str(tmp_path), i) for i in range(1, 9)]
    )
    try:
        assert wait_until(lambda: len(list(tmp_path.glob("*.pid"))) == 4, 90), "four cells never ran at once"
    finally:
        results.close()
    assert wait_until(lambda: not squeue("l9-queued", env), 60), squeue("l9-queued", env)
    assert sorted(int(p.stem) for p in tmp_path.glob("*.pid")) == [1, 2, 3, 4]


def test_a_crash_is_retried_as_a_new_job(on_slurm: None) -> None:
    assert job(slurmfns.crash_on_first_attempt, backend="slurm", retries=1).remote() == 2


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM", "SIGKILL"])
def test_stopping_the_caller_leaves_nothing_in_squeue(on_slurm: None, env: dict[str, str], tmp_path: Path, how: str) -> None:
    marker = tmp_path / "started"
    name = f"l9-stop-{how}"
    code = (f"from levers9.launch import job\nfrom tests import slurmfns\n"
            f"job(slurmfns.sleep_then, backend='slurm', name={name!r}).remote(300, {str(marker)!r})\n")  # fmt: skip
    caller = subprocess.Popen([sys.executable, "-c", code], env={**os.environ}, cwd=ROOT)
    try:
        assert wait_until(marker.exists, 90), "the job never started"
        caller.send_signal(getattr(signal, how))
        caller.wait(60)
    finally:
        if caller.poll() is None:
            caller.kill()
            caller.wait()
    pid = int(marker.read_text().split()[0])
    assert wait_until(lambda: not squeue(name, env) and not proc_util.alive(pid), 30), squeue(name, env)


def test_a_detached_job_outlives_its_caller_and_is_collected_later(
    on_slurm: None, env: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "started"
    code = (f"import time\nfrom levers9.launch import job\nfrom tests import slurmfns\n"
            f"job(slurmfns.sleep_then, backend='slurm', name='l9-detach', slurm={{'detach': True}})"
            f".spawn(5, {str(marker)!r})\ntime.sleep(300)\n")  # fmt: skip
    caller = subprocess.Popen([sys.executable, "-c", code], env={**os.environ}, cwd=ROOT)
    try:
        assert wait_until(marker.exists, 90), "the job never started"
        caller.kill()  # the caller dies; its helper process stops nothing
        caller.wait(60)
    finally:
        if caller.poll() is None:
            caller.kill()
            caller.wait()
    assert any(line.endswith("RUNNING") for line in squeue("l9-detach", env)), squeue("l9-detach", env)
    capsys.readouterr()
    assert cli_main(["runs", "result", "last", "--timeout", "90"]) == 0
    assert capsys.readouterr().out.strip() == "'slept'"
    from levers9.launch.slurm import collect as slurm_collect

    assert slurm_collect.result("last", 0) == "slept"


DETACHED_CALLER = """
import sys
from levers9.launch import job
from tests import slurmfns

fn = job(slurmfns.gated_square, backend="slurm", name="l9-detached-runs", slurm={"detach": True})
fn.spawn(6, sys.argv[1])
fn.spawn(-1, sys.argv[1])
"""


def _runs_line(capsys: pytest.CaptureFixture[str], run_id: str) -> str:
    capsys.readouterr()
    assert cli_main(["runs"]) == 0
    return next(line for line in capsys.readouterr().out.splitlines() if line.startswith(run_id))


def _show(capsys: pytest.CaptureFixture[str], run_id: str) -> str:
    capsys.readouterr()
    assert cli_main(["runs", "show", run_id]) == 0
    return capsys.readouterr().out.splitlines()[-1]


def test_a_detached_run_is_followed_from_slurm_and_resume_takes_its_value(
    on_slurm: None, env: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The caller spawns two detached jobs and exits: `levers9 runs` says what SLURM says of them (running, then
    done with the value or failed with the error), and a resume takes the value without submitting the job again."""
    before = {run.name_on_disk for run in run_reader.list_runs()}
    subprocess.run([sys.executable, "-c", DETACHED_CALLER, str(tmp_path)], env={**os.environ}, cwd=ROOT, check=True,
                   timeout=120)  # fmt: skip
    runs = sorted((r for r in run_reader.list_runs() if r.name_on_disk not in before), key=lambda r: r.started)
    good, bad = (r.name_on_disk for r in runs)
    assert wait_until(lambda: (tmp_path / "started-6").exists() and (tmp_path / "started--1").exists(), 90)
    assert _runs_line(capsys, good).split()[-2:] == ["0/0/1", "detached"]
    assert " running " in f" {_show(capsys, good)} ", _show(capsys, good)
    (tmp_path / "gate").write_text("go")
    assert cli_main(["runs", "result", good, "--timeout", "90"]) == 0
    assert capsys.readouterr().out.strip() == "36"
    assert _runs_line(capsys, good).split()[-2:] == ["1/0/1", "detached"]
    shown = _show(capsys, good)
    assert " done " in shown and shown.rstrip().endswith("36"), shown
    assert cli_main(["runs", "result", bad, "--timeout", "90"]) == 1
    shown = _show(capsys, bad)
    assert " failed " in shown and "ValueError: x=-1 is negative" in shown, shown
    assert _runs_line(capsys, bad).split()[-2:] == ["0/1/1", "detached"]
    resumed = job(slurmfns.gated_square, backend="slurm", name="l9-detached-runs").map([(6, str(tmp_path))], resume=True)
    assert list(resumed) == [36]
    assert len((tmp_path / "runs-6").read_text().splitlines()) == 1  # the job ran once: resume did not submit it


def test_a_requeued_job_resumes_from_its_checkpoint(on_slurm: None, env: dict[str, str], tmp_path: Path) -> None:
    """`scontrol requeue` (as preemption does): the job runs again, knows it (attempt 2), and resumes."""

    def requeue_when_running() -> None:  # the job starts again once its credential expires: 20 s on this cluster
        assert wait_until((tmp_path / "started-1").exists, 90)
        job_id = (tmp_path / "started-1").read_text()
        subprocess.run(["scontrol", "requeue", job_id], env=env, check=True, timeout=60)

    helper = threading.Thread(target=requeue_when_running, daemon=True)
    helper.start()
    value = job(slurmfns.resume_after_requeue, backend="slurm").remote(str(tmp_path))
    helper.join(60)
    assert value == {"runs": 2, "restart_count": "1", "attempt": 2}


def test_the_time_limit_requeues_the_job_which_resumes(on_slurm: None, env: dict[str, str], tmp_path: Path) -> None:
    """A 2-minute SLURM time limit, the early signal 45 s before it (SLURM may send it up to a minute early: 15 s
    after a run starts at the earliest, after its handler is set; with a 1-minute limit it came at a run's start and
    killed it): the function's SIGTERM handler saves for 8 s, within its stop_grace=30 (and longer than the
    cluster's KillWait of 5 s, all a requeue asked of SLURM at once would leave it); then the job is requeued, and
    the next run (attempt 2, once the old run's credential expires: 20 s on this cluster) resumes from that
    checkpoint. Takes one to two minutes."""
    value = job(slurmfns.save_at_time_limit, backend="slurm", stop_grace=30,
                slurm={"requeue": 45, "sbatch": "--time=2"}).remote(str(tmp_path), 8)  # fmt: skip
    assert value == {"attempt": 2, "resumed": "saved at the time limit"}


def test_a_slurm_tasks_handler_runs_while_it_computes_when_another_thread_got_the_signal(on_slurm: None) -> None:
    """SLURM sends its signals (the early signal, a cancel's SIGTERM) right behind a SIGCONT: on a busy node the
    kernel gives the second to another thread of the task (torch's), and up to CPython 3.12 a computing main thread
    then ran the handler only at the time limit's own signal. The task relays it (interpreter.relay_signals_to_main)."""
    seconds = job(jobfns.seconds_until_handled_from_a_thread_in_c, backend="slurm").remote(signal.SIGUSR1)
    assert seconds is not None and seconds < 5, f"the SLURM task's handler ran after {seconds} s of computing"


def test_a_requeued_jobs_next_run_killed_as_it_starts_is_named_with_the_fix(
    on_slurm: None, env: dict[str, str], tmp_path: Path
) -> None:
    """The early signal (sent here with `scancel --signal=USR2`) requeues a computing job, whose next run dies at once
    of SIGUSR2 before any handler (as SLURM's early signal kills a run that starts within a minute of it). That death
    is the next run's: the error names it, SLURM's early signal and the time limit that avoids it, not 'ended
    (COMPLETED)' (the follower read srun's line on it as the old run's, and the old run ended with no report)."""
    helper = early_signal_once((tmp_path / "ready").exists, "l9-usr2-next", env)
    with pytest.raises(JobCrashed) as caught:
        job(slurmfns.killed_by_usr2_when_requeued, backend="slurm", stop_grace=30, name="l9-usr2-next",
            slurm={"requeue": 60}).remote(str(tmp_path))  # fmt: skip
    helper.join(60)
    said = str(caught.value)
    assert (tmp_path / "saved").exists() and (tmp_path / "second run").exists(), said
    assert re.search(r"rank\(s\) 0 on l9node\d killed by SIGUSR2 \(srun: User defined signal 2\)", said), said
    assert "SLURM's early signal before the time limit (--signal=USR2@60)" in said and "over 120 s" in said, said


def test_the_early_signal_gives_the_ranks_of_a_jobs_distributed_run_their_grace(
    on_slurm: None, env: dict[str, str], tmp_path: Path
) -> None:
    """SLURM's early signal (sent at once here, with `scancel --signal=USR2` as SLURM sends it) to a job of 2 cards
    whose function calls distributed.run: each rank's handler saves (for 2 s), the job is requeued, and its next
    run (attempt 2) finds both checkpoints. (The ranks inherited the task's handler, and each started a stopper:
    the second SIGTERM ended the job process while it gave its ranks their grace, and no rank saved.)"""
    helper = early_signal_once(lambda: len(list(tmp_path.glob("ready-*"))) == 2, "l9-early-ranks", env)
    value = job(slurmfns.ranks_resume_after_requeue, gpu_count=2, backend="slurm", stop_grace=30, name="l9-early-ranks",
                slurm={"requeue": 60}).remote(str(tmp_path))  # fmt: skip
    helper.join(60)
    assert value == {"attempt": 2, "saved": ["saved-0", "saved-1"]}


def test_the_early_signal_leaves_a_job_that_did_not_ask_for_a_requeue_running(on_slurm: None, tmp_path: Path) -> None:
    """Without slurm={'requeue': ...} a job asks SLURM for no early signal (--signal=USR2@0: SLURM may send one up to
    a minute early, and killed a run that started in that minute), and a SIGUSR2 sent by hand changes nothing: the
    function runs on. (submitit's handler raised UncompletedJobError in it.)"""
    marker = tmp_path / "started"

    def signal_when_started() -> None:
        assert wait_until(marker.exists, 90)
        subprocess.run(["scancel", "--signal=USR2", marker.read_text().split()[1]], check=True, timeout=60)

    helper = threading.Thread(target=signal_when_started, daemon=True)
    helper.start()
    assert job(slurmfns.sleep_then, backend="slurm", timeout=100).remote(4, str(marker)) == "slept"
    helper.join(60)
    scripts = list((Path(os.environ["LEVERS9_STATE_DIR"]) / "runs").glob("*/slurm/*submission.sh"))
    assert len(scripts) == 1 and "#SBATCH --signal=USR2@0\n" in scripts[0].read_text()


def test_an_early_signal_shorter_than_stop_grace_is_refused(on_slurm: None, env: dict[str, str]) -> None:
    with pytest.raises(JobConfigError, match=r"requeue': 30}.* less than the job's stop_grace=60"):
        job(slurmfns.square, backend="slurm", stop_grace=60, name="l9-early", slurm={"requeue": 30}).remote(1)
    assert squeue("l9-early", env) == []


def test_the_compat_contract_script_gives_the_same_numbers_under_srun(env: dict[str, str]) -> None:
    """compat_tests/contract_script.py on 2 tasks of srun (one per node) and on 2 ranks levers9 spawns."""
    script = str(ROOT / "compat_tests" / "contract_script.py")

    def contract(done: subprocess.CompletedProcess[str]) -> tuple[dict[str, object], dict[str, object]]:
        assert done.returncode == 0, done.stderr
        lines = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines()
                 if line.startswith(("CONTRACT ", "WORLD "))}  # fmt: skip
        return lines["CONTRACT"], lines["WORLD"]

    spawned, _ = contract(subprocess.run([sys.executable, script, "--mode", "run", "--nprocs", "2"], env=env,
                                         capture_output=True, text=True, timeout=180))  # fmt: skip
    # --mode direct: the helpers make the group themselves (dist.run under srun is covered above)
    numbers, world = contract(srun(env, "-N2", "--ntasks-per-node=1", sys.executable, script, "--mode", "direct"))
    assert world["launcher"] == "slurm"
    assert numbers == spawned


def test_spawn_returns_a_future(on_slurm: None) -> None:
    future = job(slurmfns.square, backend="slurm").spawn(9)
    assert future.result(timeout=120) == 81


def test_the_workspace_switch_applies_before_anything_is_submitted(on_slurm: None, env: dict[str, str]) -> None:
    update_settings(multi_gpu=False)
    with pytest.raises(WorkspacePolicyError, match="levers9 workspace multi-gpu on"):
        job(slurmfns.square, gpu_count=2, backend="slurm", name="l9-policy").remote(1)
    assert squeue("l9-policy", env) == []


def test_doctor_shows_the_nodes_and_the_sbatch_lines_of_a_job(env: dict[str, str]) -> None:
    done = subprocess.run([sys.executable, "-m", "levers9", "doctor", "--json", "--slurm-plan", "4"], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    report = json.loads(done.stdout)["slurm"]["report"]
    # each node is in both partitions (compat_tests/slurm_cluster.sh), and listed once with both
    assert "l9node1 (l9, l9urgent): 2 GPU(s)" in report and "l9node2 (l9, l9urgent): 2 GPU(s)" in report
    assert "gpu_count=4 would be: #SBATCH --nodes=2 #SBATCH --ntasks-per-node=2 #SBATCH --gres=gpu:2" in report


def test_a_pending_cell_says_what_it_waits_for(on_slurm: None, capfd: pytest.CaptureFixture[str]) -> None:
    """Two nodes of 2 cards, three cells of 2 cards each: the third waits, and the status lines say for what."""
    cells = job(slurmfns.sleep_then, gpu_count=2, backend="slurm", slurm={"max_running": 3})
    assert list(cells.map([(4.0,), (4.0,), (4.0,)])) == ["slept", "slept", "slept"]
    err = capfd.readouterr().err
    assert "waiting for 2 free cards on one node: " in err, err[-3000:]


def test_levers9_runs_lists_a_slurm_run_with_its_job_ids(on_slurm: None, capsys: pytest.CaptureFixture[str]) -> None:
    results = job(slurmfns.square, backend="slurm").map([2, 3], progress=False)
    assert list(results) == [4, 9]
    capsys.readouterr()
    assert cli_main(["runs"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows[str(results.run_id)][2] == "slurm"
    assert cli_main(["runs", "show", str(results.run_id)]) == 0
    shown = capsys.readouterr().out
    assert shown.count("(SLURM job ") == 2, shown


# ---- srun with one task per node: torchrun and levers9 run across nodes -------------------------------


def _per_node(seen: list[dict[str, object]]) -> dict[object, list[tuple[object, object]]]:
    """node name -> [(node rank, local rank)] of its ranks."""
    nodes: dict[object, list[tuple[object, object]]] = {}
    for r in seen:
        nodes.setdefault(r["node"], []).append((r["node_rank"], r["local_rank"]))
    return nodes


def test_srun_one_task_per_node_runs_torchrun_across_nodes(env: dict[str, str], tmp_path: Path) -> None:
    """The field's recipe: srun starts torchrun once per node; c10d's rendezvous on the first node. (Two slurmd
    on one machine: the first node's name is not this machine's hostname, so its torchrun is told it hosts.)"""
    env = {**env, "TMPDIR": str(tmp_path)}  # torchrun's agent leaves its torchelastic_* folder there
    launch = (f"h=$([ $SLURM_NODEID = 0 ] && echo true || echo false); exec {sys.executable} -m torch.distributed.run "
              f"--nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint l9node1:$((20000 + SLURM_JOB_ID % 9000)) "
              f"--rdzv-conf is_host=$h --rdzv-id $SLURM_JOB_ID {RANKS}")  # fmt: skip
    done = srun(env, "-N2", "--ntasks-per-node=1", "bash", "-c", launch)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = ranks_seen(done.stdout)
    assert [r["rank"] for r in seen] == [0, 1, 2, 3]
    assert {(r["world_size"], r["local_world_size"], r["launcher"], r["sum"]) for r in seen} == {(4, 2, "torchrun", 4.0)}
    nodes = _per_node(seen)  # c10d numbers the nodes in the order their agents joined
    assert set(nodes) == {"l9node1", "l9node2"}
    assert sorted(sorted(v) for v in nodes.values()) == [[(0, 0), (0, 1)], [(1, 0), (1, 1)]]
    assert all(r["rank"] == 2 * int(str(r["node_rank"])) + int(str(r["local_rank"])) for r in seen)


def test_srun_one_task_per_node_runs_levers9_run_across_nodes(env: dict[str, str]) -> None:
    env = with_gang_secret(env)
    done = srun(env, "-N2", "--ntasks-per-node=1", sys.executable, "-m", "levers9", "run", "--nproc-per-node", "2",
                str(RANKS))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = ranks_seen(done.stdout)  # every node's output, on node 0's task, with its ranks' prefixes
    assert [(r["rank"], r["local_rank"], r["node_rank"], r["node"]) for r in seen] == [
        (0, 0, 0, "l9node1"), (1, 1, 0, "l9node1"), (2, 0, 1, "l9node2"), (3, 1, 1, "l9node2"),
    ]  # fmt: skip
    assert {(r["world_size"], r["local_world_size"], r["launcher"], r["sum"]) for r in seen} == {(4, 2, "levers9", 4.0)}
    assert len({r["master"] for r in seen}) == 1 and str(seen[0]["master"]).startswith("127.0.0.2:")  # l9node1


def test_the_compat_contract_script_under_levers9_run_across_nodes(env: dict[str, str]) -> None:
    """compat_tests/contract_script.py: 2 nodes x 1 rank of `levers9 run` under srun, the numbers of 2 spawned ranks."""
    env = with_gang_secret(env)
    script = str(ROOT / "compat_tests" / "contract_script.py")
    spawned = subprocess.run([sys.executable, script, "--mode", "run", "--nprocs", "2"], env=env, capture_output=True,
                             text=True, timeout=180)  # fmt: skip
    done = srun(env, "-N2", "--ntasks-per-node=1", sys.executable, "-m", "levers9", "run", "--nproc-per-node", "1",
                script, "--mode", "run")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]

    def lines(out: str) -> dict[str, dict[str, object]]:
        return {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) for line in out.splitlines()
                if line.startswith(("CONTRACT ", "WORLD "))}  # fmt: skip

    across = lines(done.stdout)
    assert across["WORLD"]["launcher"] == "levers9" and across["CONTRACT"]["world_size"] == 2, across["WORLD"]
    assert across["CONTRACT"] == lines(spawned.stdout)["CONTRACT"]


def test_levers9_run_across_nodes_without_a_gang_secret_is_one_error(env: dict[str, str]) -> None:
    """The store between the nodes unpickles what it reads: with no secret of the job's own, every task refuses."""
    env = {k: v for k, v in env.items() if k != "LEVERS9_GANG_SECRET"}
    done = srun(env, "-N2", "--ntasks-per-node=1", sys.executable, "-m", "levers9", "run", "--nproc-per-node", "2",
                str(RANKS), timeout=90)  # fmt: skip
    assert done.returncode == 2
    assert "levers9 run across 2 nodes under srun needs LEVERS9_GANG_SECRET" in done.stderr
    assert "export LEVERS9_GANG_SECRET=$(python -c 'import secrets; print(secrets.token_hex(16))')" in done.stderr
    assert "RANK {" not in done.stdout
    short = srun({**env, "LEVERS9_GANG_SECRET": "abc"}, "-N2", "--ntasks-per-node=1", sys.executable, "-m", "levers9",
                 "run", "--nproc-per-node", "2", str(RANKS), timeout=90)  # fmt: skip
    assert short.returncode == 2 and "it has 3 character(s); expected at least 16" in short.stderr


def test_levers9_run_twice_on_a_node_under_srun_is_one_error(env: dict[str, str]) -> None:
    done = srun(env, "-N2", "--ntasks-per-node=2", sys.executable, "-m", "levers9", "run", "--nproc-per-node", "2",
                str(RANKS), timeout=90)  # fmt: skip
    assert done.returncode == 2
    assert "levers9 run ran as one of 4 srun task(s) on 2 node(s)" in done.stderr
    assert "`srun --ntasks-per-node=1 levers9 run ...`" in done.stderr and "RANK {" not in done.stdout


def test_levers9_run_across_nodes_restarts_after_a_rank_on_node_2_is_killed(env: dict[str, str], tmp_path: Path) -> None:
    env = with_gang_secret(env)
    done = srun(env, "-N2", "--ntasks-per-node=1", sys.executable, "-m", "levers9", "run", "--nproc-per-node", "2",
                "--max-restarts", "1", str(ROOT / "tests" / "scripts" / "slurm_restart.py"), str(tmp_path))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = [json.loads(line.partition("ATTEMPT ")[2]) for line in done.stdout.splitlines() if "ATTEMPT {" in line]
    seen = sorted(seen, key=lambda r: r["rank"])
    assert [(r["rank"], r["attempt"], r["sum"], r["resumed"]) for r in seen] == [
        (0, 2, 4.0, "step 5"), (1, 2, 4.0, "step 5"), (2, 2, 4.0, "step 5"), (3, 2, 4.0, "step 5"),
    ]  # fmt: skip
    assert [r["node"] for r in seen] == ["l9node1", "l9node1", "l9node2", "l9node2"]
