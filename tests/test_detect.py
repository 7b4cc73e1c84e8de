"""Launcher detection over environment mappings: every detector, the order, and every error."""

from __future__ import annotations

import pytest

from levers9.distributed import slurm_env
from levers9.distributed.detect import DETECTORS, LaunchInfo, detect, expand_nodelist
from levers9.errors import LauncherEnvError

pytestmark = pytest.mark.fast

TORCHRUN = {
    "TORCHELASTIC_RUN_ID": "none",
    "RANK": "3",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}


def test_nothing_set_is_a_world_of_one() -> None:
    assert detect({"PATH": "/usr/bin"}) == LaunchInfo("single")


def test_torchrun() -> None:
    assert detect(TORCHRUN) == LaunchInfo("torchrun", 3, 8, 1, 2, 1, "10.0.0.1", 29500)


def test_accelerate_multi_process_is_accelerate_not_torchrun() -> None:
    info = detect({**TORCHRUN, "ACCELERATE_MIXED_PRECISION": "no"})
    assert info.launcher == "accelerate" and info.rank == 3 and info.world_size == 8


def test_accelerate_single_process_is_a_world_of_one() -> None:
    assert detect({"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_CPU": "True"}) == LaunchInfo("accelerate")


def test_accelerate_is_tried_before_torchrun() -> None:
    names = [d.__name__ for d in DETECTORS]
    assert names.index("detect_accelerate") < names.index("detect_torchrun")


def test_levers9_ranks() -> None:
    env = {"LEVERS9_LAUNCHER": "levers9", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert detect(env) == LaunchInfo("levers9", 1, 2, 1, 2, 0)


def test_torchrun_inside_srun_is_torchrun() -> None:
    env = {**TORCHRUN, "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_ID": "0", "SLURM_LOCALID": "0"}
    assert detect(env).launcher == "torchrun"


SRUN = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    "SLURM_STEP_NODELIST": "gpu[01-04,07]",
    "SLURM_JOB_ID": "123456",
}


def test_slurm_srun() -> None:
    info = detect(SRUN)
    assert info == LaunchInfo("slurm", 5, 8, 1, 4, 1, "gpu01", 10000 + 123456 % 20000)


def test_slurm_master_from_env_wins() -> None:
    info = detect({**SRUN, "MASTER_ADDR": "head", "MASTER_PORT": "1234"})
    assert (info.master_addr, info.master_port) == ("head", 1234)


def test_sbatch_script_without_srun_is_not_a_rank() -> None:
    env = {k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"}
    assert detect(env).launcher == "single"


@pytest.mark.parametrize("step", ["-5", "-4", "4294967291"])  # the batch and extern steps: SLURM 24+, and unsigned
def test_a_job_scripts_own_step_id_is_not_an_srun_step(step: str) -> None:
    """SLURM 24 and later export SLURM_STEP_ID=-5 to the job script itself (seen on 26.05, Debian unstable's): it
    is no task of srun's, and a script that asked for several tasks is told to use srun instead of waiting for
    peers that never start."""
    env = {**SRUN, "SLURM_STEP_ID": step, "SLURM_STEPID": step}
    assert detect(env).launcher == "single"
    with pytest.raises(LauncherEnvError, match="was not started by srun"):
        slurm_env.check_started_by_srun({**env, "SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_JOB_NUM_NODES": "2"})


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
        ("node7", ["node7"]),
        ("a[1-2],b3", ["a1", "a2", "b3"]),
        ("n[008-010]", ["n008", "n009", "n010"]),
        ("gpu[1-2]-ib", ["gpu1-ib", "gpu2-ib"]),  # a suffix after the brackets (InfiniBand host names)
        ("gpu[1-2]-ib,login[3]", ["gpu1-ib", "gpu2-ib", "login3"]),
    ],
)
def test_expand_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


def test_the_master_address_under_srun_is_the_first_host_of_a_suffixed_nodelist() -> None:
    assert detect({**SRUN, "SLURM_STEP_NODELIST": "gpu[3-4]-ib"}).master_addr == "gpu3-ib"


def test_a_malformed_nodelist_names_the_variable() -> None:
    with pytest.raises(LauncherEnvError, match=r"SLURM_STEP_NODELIST='gpu\[1-2' is not a SLURM host list"):
        detect({**SRUN, "SLURM_STEP_NODELIST": "gpu[1-2"})


def test_open_mpi() -> None:
    env = {
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "OMPI_COMM_WORLD_NODE_RANK": "1",
        "MASTER_ADDR": "h0",
    }
    assert detect(env) == LaunchInfo("mpi", 3, 4, 1, 2, 1, "h0", None)


def test_mpich_and_intel_mpi() -> None:
    env = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
    assert detect(env) == LaunchInfo("mpi", 2, 4, 0, 2, 1)


def test_rank_and_world_size_by_hand_or_by_an_operator() -> None:
    env = {"RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}
    assert detect(env) == LaunchInfo("env", 2, 4, 0, 1, 2, "job-master-0", 23456)


def test_by_hand_with_local_rank_is_one_node() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    assert detect(env) == LaunchInfo("env", 1, 2, 1, 2, 0)


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"RANK": "0"}, ["RANK=0", "WORLD_SIZE"]),
        ({"WORLD_SIZE": "2"}, ["WORLD_SIZE=2", "RANK"]),
        ({"LOCAL_RANK": "1"}, ["LOCAL_RANK=1", "RANK", "WORLD_SIZE"]),
        ({"RANK": "2", "WORLD_SIZE": "2"}, ["RANK=2", "WORLD_SIZE=2"]),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, ["RANK=-1"]),
        ({"RANK": "x", "WORLD_SIZE": "2"}, ["RANK='x'"]),
        ({"RANK": "0", "WORLD_SIZE": "0"}, ["WORLD_SIZE=0"]),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, ["LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2"]),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4"}, ["LOCAL_WORLD_SIZE=4", "WORLD_SIZE=2"]),
        ({"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2"}, ["TORCHELASTIC_RUN_ID", "LOCAL_RANK", "LOCAL_WORLD_SIZE"]),
        ({"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2"}, ["SLURM_LOCALID"]),
        ({"OMPI_COMM_WORLD_RANK": "0"}, ["OMPI_COMM_WORLD_SIZE"]),
    ],
)
def test_partial_or_contradictory_environment_is_an_error_naming_the_variables(env: dict[str, str], names: list[str]) -> None:
    with pytest.raises(LauncherEnvError) as info:
        detect(env)
    for name in names:
        assert name in str(info.value)


def test_errors_say_how_to_fix() -> None:
    with pytest.raises(LauncherEnvError, match="torchrun --nproc-per-node"):
        detect({"RANK": "0"})


def test_a_step_of_one_task_is_not_a_launched_world() -> None:
    """`srun -n1` or a submitted job of one task: distributed.run must start one rank per card itself."""
    one = {**SRUN, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS": "1",
           "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_TASKS_PER_NODE": "1"}  # fmt: skip
    assert detect(one).launcher == "single"


def test_slurm_ports_differ_between_neighbouring_jobs_and_concurrent_steps() -> None:
    from levers9.distributed.slurm_env import master_port

    ports = {master_port({"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": str(step)}) for job in range(5000, 5100) for step in range(4)}
    assert len(ports) == 400
    assert all(p is not None and 10000 <= p < 30000 for p in ports)
    assert master_port({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "batch"}) == master_port({"SLURM_JOB_ID": "77"})
    assert master_port({}) is None
