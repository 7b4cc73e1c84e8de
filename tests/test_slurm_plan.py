"""How a job is asked of SLURM, without a cluster: the cards split across nodes and the slurm= options."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from levers9.errors import InfeasibleJobError, JobConfigError, LauncherEnvError, SettingsError
from levers9.launch import job
from levers9.launch.slurm import merged, sbatch_options
from levers9.launch.slurm.nodes import SlurmNode, SlurmPlan, _gres_gpus, _gres_types, plan_job
from levers9.launch.spec import JobSpec
from tests import jobfns

pytestmark = pytest.mark.fast


def nodes(*cards: int) -> list[SlurmNode]:
    return [SlurmNode(f"gpu{i}", n, 32, "gpu", "idle") for i, n in enumerate(cards)]


@pytest.mark.parametrize(
    ("count", "cards", "plan"),
    [
        (0, (4, 4), SlurmPlan(1, 1, 0)),
        (4, (4, 4), SlurmPlan(1, 1, 4)),
        (8, (4, 4), SlurmPlan(2, 4, 4)),
        (6, (4, 4, 4), SlurmPlan(2, 3, 3)),  # fewest nodes with equal shares
        (12, (8, 4, 4, 4), SlurmPlan(3, 4, 4)),
        (8, (8, 2), SlurmPlan(1, 1, 8)),
    ],
)
def test_cards_go_to_one_node_else_the_fewest_nodes_with_equal_shares(count: int, cards: tuple[int, ...], plan: SlurmPlan) -> None:
    assert plan_job(JobSpec("j", gpu_count=count), nodes(*cards), None) == plan


def test_a_job_no_split_could_hold_names_the_nodes() -> None:
    with pytest.raises(InfeasibleJobError, match=r"partition 'gpu' can never hold them.*gpu0 \(4 GPU\(s\)"):
        plan_job(JobSpec("j", gpu_count=7), nodes(4, 4), "gpu")


def test_gres_strings_as_sinfo_prints_them() -> None:
    assert [_gres_gpus(g) for g in ("gpu:2", "gpu:a100:4(S:0-1)", "gpu:a100:4,gpu:v100:2", "(null)", "mps:100")] == [2, 4, 6, 0, 0]


def test_gres_types_as_sinfo_prints_them() -> None:
    assert _gres_types("gpu:a100:4(S:0-1),gpu:v100:2") == (("a100", 4), ("v100", 2))
    assert _gres_types("gpu:2") == (("", 2),) and _gres_types("(null)") == ()


def typed(*types: tuple[tuple[str, int], ...]) -> list[SlurmNode]:
    return [SlurmNode(f"gpu{i}", sum(n for _, n in t), 32, "gpu", "idle", t) for i, t in enumerate(types)]


def test_a_gpu_type_is_asked_as_the_clusters_gres_type() -> None:
    cluster = typed((("a100", 4),), (("h100", 2), ("v100", 2)), (("h100", 2),))
    assert plan_job(JobSpec("j", gpu_types=("H100",), gpu_count=2), cluster, None) == SlurmPlan(1, 1, 2, "h100")
    assert plan_job(JobSpec("j", gpu_types=("H100",), gpu_count=4), cluster, None) == SlurmPlan(2, 2, 2, "h100")
    assert plan_job(JobSpec("j", gpu_types=("H100", "A100-40"), gpu_count=4), cluster, None) == SlurmPlan(1, 1, 4, "a100")
    assert SlurmPlan(2, 1, 2, "h100").gres == "gpu:h100:2" and SlurmPlan(1, 1, 2).gres == "gpu:2"
    assert plan_job(JobSpec("j", gpu_count=4), cluster, None) == SlurmPlan(1, 1, 4)  # any type


def test_a_gpu_type_the_cluster_lacks_is_refused_naming_its_types() -> None:
    with pytest.raises(InfeasibleJobError, match=r"gpu='L40S'.*no node of the cluster has that type: its cards are "
                                                 r"a100 \(A100-40\), h100 \(H100\)"):  # fmt: skip
        plan_job(JobSpec("j", gpu_types=("L40S",), gpu_count=1), typed((("a100", 4),), (("h100", 2),)), None)
    with pytest.raises(InfeasibleJobError, match=r"declared without a type \(gres.conf has no Type=\)"):
        plan_job(JobSpec("j", gpu_types=("L40S",), gpu_count=1), nodes(4), None)


def test_slurm_options_are_checked_at_decoration() -> None:
    with pytest.raises(JobConfigError, match="has the key 'partiton'; expected some of: partition"):
        job(backend="slurm", slurm={"partiton": "gpu"})(jobfns.add)
    with pytest.raises(JobConfigError, match="'-C' is not a long sbatch option"):
        job(backend="slurm", slurm={"sbatch": "-C a100"})(jobfns.add)
    with pytest.raises(JobConfigError, match="max_running'\\] must be a whole number"):
        job(backend="slurm", slurm={"max_running": 0})(jobfns.add)
    spec = job(backend="slurm", slurm={"qos": "high", "partition": "gpu"})(jobfns.add).spec
    assert merged(spec.options_for("slurm"), {"partition": "cpu", "account": "lab", "qos": None}) == {
        "partition": "gpu", "account": "lab", "qos": "high"}  # fmt: skip


def test_a_keyword_that_is_neither_jobs_nor_a_backends_is_refused_by_name() -> None:
    """@job's keywords beyond its own are a backend's options under the backend's name; a misspelt argument is
    not taken for one."""
    with pytest.raises(JobConfigError, match=r"@job got the keyword gpu_cuont=2, .* \(slurm=\{\.\.\.\}\); check its"):
        job(gpu_cuont=2)(jobfns.add)  # type: ignore[call-overload]
    assert job(slurm={})(jobfns.add).spec.backend_options == ()


def test_the_workspaces_slurm_table_is_read_and_checked_by_the_slurm_backends_options(tmp_path: Path) -> None:
    from levers9.launch.settings import load_settings, render

    path = tmp_path / "workspace.toml"
    path.write_text('[slurm]\npartition = "gpu"\nqos = "high"\nnodes = 3\n')
    path.chmod(0o600)
    assert load_settings(path).backend_table("slurm") == {"partition": "gpu", "qos": "high"}  # nodes: ignored
    assert load_settings(path).backend_table("slurm") != {} and load_settings(tmp_path / "none.toml").backend_table("slurm") == {}
    path.write_text("[slurm]\naccount = 5\n")
    with pytest.raises(SettingsError, match=r"slurm.account must be a string: #SBATCH --account .*got 5"):
        load_settings(path).backend_table("slurm")
    assert "[slurm]\n# partition = " in render(load_settings(tmp_path / "none.toml"))  # a new file explains it


def test_sbatch_options_as_submitit_takes_them() -> None:
    assert sbatch_options("--exclusive --constraint=a100 --gres-flags enforce-binding") == {
        "exclusive": True, "constraint": "a100", "gres-flags": "enforce-binding"}  # fmt: skip


def test_the_reapers_own_copy_of_the_ended_states_is_the_one_readers() -> None:
    """launch/slurm/reaper.py runs as a script of its own (it imports nothing of levers9's), so it keeps a copy of the states
    of a job SLURM is done with: the same set as the one squeue reader's."""
    import importlib.util

    from levers9.launch.slurm import collect as slurm_collect
    from levers9.launch.slurm import follow as slurm_follow

    spec = importlib.util.spec_from_file_location("levers9_slurm_reaper", slurm_follow.REAPER)
    assert spec is not None and spec.loader is not None
    reaper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reaper)
    assert set(reaper.ENDED) == set(slurm_collect.ENDED)


def test_the_ranks_of_a_job_across_nodes_meet_where_rank_0_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 serves the store on a port it bound, names it in the job's folder, and rank 1 reads it there; both get
    the same variables, the secret among them. A MASTER_PORT from env= that is taken is one error naming it."""
    from levers9.distributed.group import STORE_SECRET_VAR
    from levers9.launch.slurm import task as slurm_task

    monkeypatch.setattr(slurm_task, "_served", [])
    for name, value in {"SLURM_JOB_ID": "77", "SLURMD_NODENAME": "localhost", "SLURM_PROCID": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    rank0 = slurm_task._meeting_place(str(tmp_path), "s" * 32)
    assert (tmp_path / "77_0_store").read_text() == f"localhost {rank0['MASTER_PORT']}"
    monkeypatch.setenv("SLURM_PROCID", "1")
    assert slurm_task._meeting_place(str(tmp_path), "s" * 32) == rank0
    assert rank0[STORE_SECRET_VAR] == "s" * 32 and rank0["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen(1)
        monkeypatch.setenv("SLURM_PROCID", "0")
        monkeypatch.setenv("MASTER_PORT", str(taken.getsockname()[1]))
        with pytest.raises(LauncherEnvError, match=r"the port is MASTER_PORT=\d+, from the job's env=.*drop MASTER_PORT"):
            slurm_task._meeting_place(str(tmp_path / "other"), "s" * 32)


def _slurm_commands(folder: Path, enforce: str, assoc: str, assoc_exit: int = 0) -> str:
    """A PATH where `scontrol show config` and `sacctmgr show assoc` answer as a cluster would (the commands are
    the boundary the check reads; the real cluster's case is tests/test_slurm.py)."""
    (folder / "scontrol").write_text(f"#!/bin/sh\nprintf 'ClusterName             = lab\\nAccountingStorageEnforce = {enforce}\\n'\n")
    (folder / "sacctmgr").write_text(f"#!/bin/sh\nprintf '{assoc}'\nexit {assoc_exit}\n")
    for name in ("scontrol", "sacctmgr"):
        (folder / name).chmod(0o755)
    return f"{folder}:/usr/bin:/bin"


def test_account_and_qos_are_checked_only_where_accounting_enforces_them_and_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from levers9.launch.slurm.nodes import check_account_and_qos

    monkeypatch.setenv("PATH", _slurm_commands(tmp_path, "associations,limits,qos", "lab|normal,fast\\n"))
    check_account_and_qos("lab", "fast")
    with pytest.raises(JobConfigError, match=r"charge no account 'nosuch'; the accounts \S+ may use are: lab "):
        check_account_and_qos("nosuch", None)
    with pytest.raises(JobConfigError, match=r"use no QOS 'slow' under account 'lab'; the QOS allowed are: fast, normal"):
        check_account_and_qos("lab", "slow")
    monkeypatch.setenv("PATH", _slurm_commands(tmp_path, "none", "lab|normal\\n"))
    check_account_and_qos("nosuch", "slow")  # not enforced: SLURM ignores both, sbatch judges
    monkeypatch.setenv("PATH", _slurm_commands(tmp_path, "associations", "", assoc_exit=1))
    check_account_and_qos("nosuch", None)  # slurmdbd did not answer: sbatch judges



def test_a_detached_cells_failures_are_built_as_every_backends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`levers9 runs result` on a detached SLURM cell: its own exception (rebuilt, with where it ran), a job that ended
    without a result, and one still running when the wait is over, each as the job layer's one builder makes it. The
    run folder is a real one; squeue and the task's result file are the boundary it reads."""
    from submitit.core import utils as submitit_utils

    from levers9.errors import JobCrashed, JobTimeout
    from levers9.launch import run_reader
    from levers9.launch.job_process import TaskEnded
    from levers9.launch.slurm import collect as slurm_collect
    from levers9.procs.failure import capture
    from levers9.procs.outcome import Outcome

    job(name="collected")(jobfns.add).remote(1, 2)  # a run folder of this user's, as a SLURM batch makes one
    folder = run_reader.find_run("last").path / "slurm"
    folder.mkdir()
    (folder / slurm_collect.JOBS_FILE).write_text('{"0": "77"}')
    try:
        raise KeyError("boom")
    except KeyError as exc:
        failure = capture(exc)
    ended = TaskEnded.of(Outcome(5, 1, None, failure=failure, reported=True), 0, "l9node2")
    submitit_utils.cloudpickle_dump(("success", ended), folder / "77_0_result.pkl")
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")  # squeue: none yet, so nothing is known to run
    with pytest.raises(KeyError, match="boom") as raised:
        slurm_collect.result("last", 0)
    assert any("traceback of SLURM job 77" in note and "on l9node2" in note for note in raised.value.__notes__)
    (folder / "77_0_result.pkl").unlink()
    with pytest.raises(JobCrashed, match=r"SLURM job 77 \(run \S+, cell 0\) ended without a result .* Its output: \S+77_0_log.err"):
        slurm_collect.result("last", 0)
    (tmp_path / "squeue").write_text("#!/bin/sh\necho '77|RUNNING|None|l9node1'\n")
    (tmp_path / "squeue").chmod(0o755)
    with pytest.raises(JobTimeout, match=r"SLURM job 77 \(run \S+, cell 0\) still runs after 0.2 s. Wait longer"):
        slurm_collect.result("last", 0, timeout=0.2)


def test_srun_words_on_a_task_ended_by_any_signal_name_the_signal() -> None:
    """srun says how a task ended in strsignal's words ('User defined signal 2', 'Bus error'; '(core dumped)' after
    some): each is read as its signal, an exit code as itself, and srun's other error lines as no task's end."""
    from levers9.launch.slurm.follow import SRUN_SIGNALS, srun_error

    said = {
        "srun: error: l9node1: task 0: User defined signal 2": ("l9node1", "0", "SIGUSR2"),
        "srun: error: l9node2: tasks 2-3: Killed": ("l9node2", "2-3", "SIGKILL"),
        "srun: error: l9node1: task 1: Segmentation fault (core dumped)": ("l9node1", "1", "SIGSEGV"),
        "srun: error: l9node1: task 0: Bus error": ("l9node1", "0", "SIGBUS"),
        "srun: error: l9node1: task 0: Terminated": ("l9node1", "0", "SIGTERM"),
    }
    for line, (node, tasks, name) in said.items():
        ended = srun_error(line)
        assert ended is not None and ended[:2] == (node, tasks) and SRUN_SIGNALS[ended[2]] == name, (line, ended)
    assert srun_error("srun: error: l9node1: task 3: Exited with exit code 7") == ("l9node1", "3", "Exited with exit code 7")
    for other in ("srun: error: Node failure on l9node2", "srun: error: l9node1: task 0: Something went wrong",
                  "srun: Job step aborted: Waiting up to 7 seconds for job step to finish."):  # fmt: skip
        assert srun_error(other) is None, other


def test_a_slurm_jobs_ranks_end_on_the_core_supervisors_rules(tmp_path: Path) -> None:
    """A SLURM job's tasks as the one Supervisor watches them: a rank killed as srun says has no report and is the
    root cause over the peers whose reports only say they lost it, by procs.outcome.root_cause; a report's failure
    time (another node's wall clock) is made this machine's; the window waits for the earlier failure."""
    import signal
    import time

    from submitit.core import utils as submitit_utils

    from levers9.launch.job_process import TaskEnded
    from levers9.launch.slurm.follow import ROOT_WAIT_S, SlurmRank, expand_ranks, srun_error
    from levers9.procs.failure import capture
    from levers9.procs.outcome import Outcome, root_cause, wall_clock
    from levers9.procs.supervise import Supervisor

    assert expand_ranks("3") == [3] and expand_ranks("0,2-3") == [0, 2, 3]
    ranks = [SlurmRank(tmp_path / f"5_{t}_result.pkl") for t in range(3)]
    stopped: list[str] = []
    supervisor = Supervisor(None, ranks, timeout=None, grace=1.0, stop_on_failure=True,
                            before_stop=lambda reason: stopped.append(reason.value), window=60.0, peer_loss_window=ROOT_WAIT_S)  # fmt: skip
    assert not supervisor.step(0) and not stopped  # no rank has ended
    try:
        raise RuntimeError("Connection closed by peer")
    except RuntimeError as exc:
        lost = capture(exc)
    assert lost.peer_loss
    earlier = time.monotonic() - 30
    ended = TaskEnded(Outcome(7, 1, None, failure=lost, reported=True), wall_clock(earlier), 2, "l9node2")
    submitit_utils.cloudpickle_dump(("success", ended), tmp_path / "5_2_result.pkl")
    assert not supervisor.step(0) and ranks[2].reported and ranks[2].failure is not None
    assert abs(ranks[2].failure.when - earlier) < 1.0  # on this machine's clock
    node, tasks, how = srun_error("srun: error: l9node1: task 1: Killed") or ("", "", "")
    for rank in expand_ranks(tasks):
        ranks[rank].ended_unreported(how)
    assert ranks[1].status == (None, signal.SIGKILL) and not ranks[1].reported
    assert not supervisor.step(0)  # a failure of its own: the window (60 s here) for an earlier one runs
    supervisor.window = 0.0
    assert supervisor.step(0) and stopped == ["sibling"]
    outcomes = supervisor.outcomes()
    assert outcomes[0].stopped_for is not None  # rank 0 was running: stopped for its peer
    assert outcomes.index(root_cause([o for o in outcomes if not o.succeeded])) == 1  # the killed rank, not rank 2
    reported_first = SlurmRank(tmp_path / "5_0_result.pkl")  # a report written before srun's word on its end: kept
    submitit_utils.cloudpickle_dump(("success", TaskEnded.of(Outcome(9, 0, None, value=b"v", reported=True))),
                                    reported_first.path)  # fmt: skip
    reported_first.ended_unreported("Killed")
    assert reported_first.reported and reported_first.status == (0, None) and reported_first.result == b"v"
