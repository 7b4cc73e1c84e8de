"""`levers9 run`, `distributed.run_script` and `distributed.spawn`: scripts written for torchrun or
mp.spawn run unchanged, with torchrun's outcome, exit codes and environment, and bad input refused."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

from levers9 import distributed as dist
from levers9.cli import main as cli_main
from levers9.errors import ConfigError, FailureKind, RankCrashed, RankFailed
from levers9.launch import job
from levers9.launch.settings import update_settings
from tests import scriptfns
from tests.proc_util import board_folders_of, children_of, free_port, left_behind

pytestmark = pytest.mark.launchers

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = scriptfns.SCRIPTS
ACCELERATE_SCRIPTS = Path(__import__("accelerate").__file__).parent / "test_utils" / "scripts"


@pytest.fixture(autouse=True)
def no_leftover_processes() -> Iterator[None]:
    before = set(children_of(os.getpid()))
    yield
    assert left_behind(before) == [], "a run left child processes running"
    assert not board_folders_of(os.getpid()), "board folder left behind"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def levers9_run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return _launch([sys.executable, "-m", "levers9", "run", *args], timeout)


def torchrun(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return _launch([sys.executable, "-m", "torch.distributed.run", "--standalone", *args], timeout)


def _launch(command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run a launcher with a $TMPDIR of its own: torchrun's agent leaves torchelastic_* folders there, and
    the scripts' torch leaves torchinductor_<user>."""
    with tempfile.TemporaryDirectory() as tmp:
        return subprocess.run(command, env={**_env(), "TMPDIR": tmp}, capture_output=True, text=True, timeout=timeout)


def _lines(out: str, marker: str) -> list[str]:
    """Every piece of `out` that starts at `marker`, up to the next one or the end of its line, sorted.

    Under torchrun both ranks share one stdout, and with PYTHONUNBUFFERED a print writes its text and
    its newline separately, so two ranks' lines can run together on one line.
    """
    return sorted(marker + piece for line in out.splitlines() for piece in line.split(marker)[1:])


# -- scripts nobody here wrote, under both launchers ---------------------------------------------


# Over 20 s in the three-worker suite (test_sync.py about 9 s alone on 2 idle cores): accelerate's own
# script under `levers9 run`, then under torchrun as the reference, each rank importing torch and accelerate.
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("script", "marker"), [("test_ops.py", "testing "), ("test_sync.py", "dtype")])
def test_accelerate_test_scripts_pass_as_under_torchrun(script: str, marker: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if script == "test_ops.py":
        # What `accelerate launch --cpu` sets: from accelerate 1.16 on, test_ops.py's PartialState on a machine
        # without a GPU counts one process unless told the run is on the CPU (it fails under torchrun too).
        # Only there: test_sync.py passed without it in every run before, and with it torchrun's own run lost
        # rank 0 to SIGABRT once in CI.
        monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    path = str(ACCELERATE_SCRIPTS / script)
    ours = levers9_run("--nproc-per-node", "2", path)
    theirs = torchrun("--nproc-per-node", "2", path)
    if theirs.returncode != 0:  # the reference itself: once in CI, torchrun's rank 0 died of SIGABRT in test_sync.py
        theirs = torchrun("--nproc-per-node", "2", path)
    assert theirs.returncode == 0, theirs.stderr[-2000:]
    assert ours.returncode == 0, ours.stderr[-2000:]
    mine, torchruns = _lines(ours.stdout, marker), _lines(theirs.stdout, marker)
    # Under torchrun both ranks share one stdout, so a piece can carry the other rank's unmarked text after it,
    # and pairing sorted pieces then goes wrong (seen once): each line levers9's ranks printed must appear in
    # torchrun's output at least as often (a line that is a prefix of another is counted in both).
    assert mine and len(mine) == len(torchruns), (mine, torchruns)
    missing = {m: (mine.count(m), theirs.stdout.count(m)) for m in set(mine) if theirs.stdout.count(m) < mine.count(m)}
    assert not missing, missing


# Over 20 s in the three-worker suite (about 9 s alone on 2 idle cores): the tutorial under `levers9 run`,
# then under torchrun as the reference (its agent and both ranks each import torch).
@pytest.mark.timeout(180)
def test_ddp_tutorial_script_gives_torchrun_outcome() -> None:
    path = str(SCRIPTS / "elastic_ddp.py")
    ours, theirs = levers9_run("--nproc-per-node", "2", path), torchrun("--nproc-per-node", "2", path)
    assert ours.returncode == theirs.returncode == 0, ours.stderr[-2000:] + theirs.stderr[-2000:]
    finished = _lines(ours.stdout, "Finished running")
    assert finished == _lines(theirs.stdout, "Finished running")
    assert len(finished) == 2 and len({line.split("checksum=")[1] for line in finished}) == 1  # DDP kept them equal


@pytest.mark.timeout(180)
def test_each_rank_gets_torchruns_worker_environment() -> None:
    path = str(SCRIPTS / "worker_env.py")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    runs = []
    for command in (["-m", "levers9", "run"], ["-m", "torch.distributed.run", "--standalone"]):
        with tempfile.TemporaryDirectory() as tmp:  # torchrun's agent leaves torchelastic_* folders in $TMPDIR
            done = subprocess.run(
                [sys.executable, *command, "--nproc-per-node", "2", path, "x", "--y"],
                env={**env, "PYTHONPATH": str(REPO), "TMPDIR": tmp},
                capture_output=True,
                text=True,
                timeout=120,
            )
        assert done.returncode == 0, done.stderr[-2000:]
        seen = {json.loads(line)["RANK"]: json.loads(line) for line in _lines(done.stdout, "ENV ") for line in [line[4:]]}
        runs.append((seen, done.stderr))
    (ours, our_err), (theirs, _) = runs
    assert sorted(ours) == sorted(theirs) == ["0", "1"]
    differ_by_design = {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"}
    for rank in ("0", "1"):
        assert set(ours[rank]) == set(theirs[rank])
        for name, value in theirs[rank].items():
            if name not in differ_by_design:
                assert ours[rank][name] == value, (rank, name)
        assert ours[rank]["MASTER_ADDR"] == "127.0.0.1" and ours[rank]["TORCHELASTIC_RUN_ID"]
    assert ours["0"]["is_torchelastic_launched"] is True and ours["0"]["argv"] == ["x", "--y"]
    assert our_err.count("OMP_NUM_THREADS is unset") == 1  # said once, not once per rank


@pytest.mark.timeout(120)
def test_accelerator_script_under_levers9_run() -> None:
    done = levers9_run("--nproc-per-node", "2", str(SCRIPTS / "accelerate_loop.py"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "num_processes=2 gathered=[0, 1]" in done.stdout


@pytest.mark.timeout(120)
def test_module_and_one_rank() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "levers9", "run", "--nproc_per_node", "1", "-m", "tests.scripts.worker_env", "z"],
        env=_env(), cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(_lines(done.stdout, "ENV ")[0][4:])
    assert seen["WORLD_SIZE"] == "1" and seen["main"] == "__main__" and seen["argv"] == ["z"]
    assert "OMP_NUM_THREADS is unset" not in done.stderr


# -- failures and exit codes ---------------------------------------------------------------------


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("mode", "rank_status", "said"), [
    ("raise", 1, "ValueError: rank 1 could not read its shard"),
    ("exit3", 3, "exit status was 3"),
    ("kill9", 128 + 9, "SIGKILL"),
    ("segv", 128 + 11, "SIGSEGV"),
])
def test_exit_status_is_torchruns_and_the_ranks_own_on_request(mode: str, rank_status: int, said: str) -> None:
    """levers9 run exits as torchrun does (measured side by side); --rank-exit-status gives the rank's own status."""
    script = str(SCRIPTS / "fail.py")
    theirs = torchrun("--nproc-per-node", "2", script, mode, timeout=120)
    ours = levers9_run("--nproc-per-node", "2", script, mode, timeout=60)
    assert ours.returncode == theirs.returncode == 1, (theirs.returncode, ours.stderr[-2000:])
    assert said in ours.stderr and "rank 1" in ours.stderr
    if mode == "raise":
        assert "Traceback from rank 1" in ours.stderr and 'fail.py", line' in ours.stderr
        assert "runpy" not in ours.stderr and "rank_process.py" not in ours.stderr  # the script's frames only
    informative = levers9_run("--rank-exit-status", "--nproc-per-node", "2", script, mode, timeout=60)
    assert informative.returncode == rank_status, informative.stderr[-2000:]


@pytest.mark.timeout(60)
def test_a_rank_that_exits_0_early_is_not_a_failure() -> None:
    done = levers9_run("--nproc-per-node", "2", str(SCRIPTS / "fail.py"), "early0", timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "rank 0 finished after rank 1 left" in done.stdout


OTHER_UID = 65534  # nobody: another local user


@pytest.mark.timeout(60)
def test_log_dir_in_a_shared_folder_never_writes_through_what_another_user_planted(tmp_path: Path) -> None:
    """--log-dir gets a fresh private folder per run (as torchrun makes), so a symlink another user put at
    the predictable <log dir>/0/stdout.log appends nothing to the victim's file."""
    shared = tmp_path / "shared"  # like /tmp: anyone may create things in it
    shared.mkdir()
    shared.chmod(0o1777)
    victim = tmp_path / "private.txt"
    victim.write_text("the victim's own\n")
    victim.chmod(0o600)
    planted = shared / "0"
    planted.mkdir()
    (planted / "stdout.log").symlink_to(victim)
    for path in (planted, planted / "stdout.log"):
        os.lchown(path, OTHER_UID, OTHER_UID)
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('hello from rank', os.environ['RANK'], flush=True)\n")
    done = levers9_run("--nproc-per-node", "2", "--log-dir", str(shared), str(script), timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert victim.read_text() == "the victim's own\n"
    (fresh,) = [p for p in shared.iterdir() if p.name.startswith("levers9-")]
    assert str(fresh) in done.stderr  # said where the logs went
    info = os.lstat(fresh)
    assert info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) == 0o700 and stat.S_ISDIR(info.st_mode)
    for rank in (0, 1):
        log = fresh / str(rank) / "stdout.log"
        assert log.read_text() == f"hello from rank {rank}\n"
        assert stat.S_IMODE(log.stat().st_mode) == 0o600
        assert stat.S_IMODE((fresh / str(rank)).stat().st_mode) == 0o700


# -- bad command lines: seen -> expected -> fix, nothing started ---------------------------------


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = cli_main(["run", *argv])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("argv", "needles"), [
    (["no_such_train.py"], ["'no_such_train.py' does not exist", "Expected a path"]),
    (["-m", "no_such_module_xyz"], ["module 'no_such_module_xyz'", "cannot be found", "check its spelling"]),
    (["--nproc-per-node", "0", "SCRIPT"], ["--nproc-per-node=0", "expected a whole number", "e.g."]),
    (["--nproc-per-node", "abc", "SCRIPT"], ["--nproc-per-node='abc'", "gpu, cpu, auto", "e.g."]),
    (["--nproc-per-node", "gpu", "SCRIPT"], ["sees no CUDA card", "Expected at least one card", "--nproc-per-node=cpu"]),
    (["--nnodes", "2", "SCRIPT"], ["--nnodes 2", "needs LEVERS9_GANG_SECRET", "export LEVERS9_GANG_SECRET="]),
    (["--node-rank", "1", "SCRIPT"], ["--node-rank 1", "--nnodes 2 --node-rank <i>", "srun"]),
    (["--master-addr", "10.0.0.7", "SCRIPT"], ["10.0.0.7", "another machine", "torchrun"]),
])
def test_bad_command_lines(capsys: pytest.CaptureFixture[str], argv: list[str], needles: list[str]) -> None:
    argv = [str(SCRIPTS / "elastic_ddp.py") if a == "SCRIPT" else a for a in argv]
    code, err = _cli(capsys, *argv)
    assert code == 2
    for needle in needles:
        assert needle in err


@pytest.mark.parametrize("launcher_env", [
    {"TORCHELASTIC_RUN_ID": "abc", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"},
    {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"},
    {"LEVERS9_LAUNCHER": "levers9", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
])
def test_refused_inside_a_rank(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, launcher_env: dict[str, str]
) -> None:
    for key, value in launcher_env.items():
        monkeypatch.setenv(key, value)
    code, err = _cli(capsys, "--nproc-per-node", "2", str(SCRIPTS / "elastic_ddp.py"))
    assert code == 2 and "was started inside rank" in err and "from a plain shell" in err
    with pytest.raises(ConfigError, match="started inside rank"):
        dist.run_script(str(SCRIPTS / "elastic_ddp.py"), nprocs=2)


def test_run_script_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="list of strings"):
        dist.run_script(str(SCRIPTS / "elastic_ddp.py"), "--epochs 3")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="add -m"):
        dist.run_script("tests.scripts.worker_env")


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["--version"])
    assert exit_info.value.code == 0
    from levers9 import __version__

    assert capsys.readouterr().out.strip() == f"levers9 {__version__}"


# -- distributed.run / spawn / jobs around code written for torchrun or mp.spawn -----------------


@pytest.mark.timeout(120)
def test_classic_torchrun_main_inside_distributed_run() -> None:
    out = dist.run(scriptfns.torchrun_main, nprocs=2, init_group=False)
    assert out == {"rank": 0, "world": 2, "sum": 3.0, "elastic": True}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("launcher", ["torchrun", pytest.param("accelerate", marks=pytest.mark.xdist_group("port-29500"))])
def test_torchrun_code_inside_distributed_run_under_a_launcher(launcher: str) -> None:
    """Under a launcher, run joins the launcher's group before fn (torch.distributed answers right at fn's top);
    with init_group=False fn's own init_process_group works, and rank 0's value reaches every rank through a
    group made for it once fn destroyed its own."""
    script = str(SCRIPTS / "runs_torchrun_code.py")
    if launcher == "torchrun":
        done = torchrun("--nproc-per-node", "2", script)
    else:
        done = _launch([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", script], 240)
    assert done.returncode == 0, done.stderr[-3000:]
    classic = json.dumps({"rank": 0, "world": 2, "sum": 3.0, "elastic": True})
    sees = json.dumps({"initialized": True, "idiom_rank": 0, "world": 2, "group_world_set": True, "every_rank": [0, 1]})
    assert _lines(done.stdout, "RESULT ") == sorted(2 * [
        f"RESULT torchrun_main {classic}", "RESULT raw_collective 3.0", f"RESULT what_fn_sees {sees}",
    ])


@pytest.mark.timeout(120)
def test_helpers_make_their_own_group_after_the_user_destroyed_theirs() -> None:
    assert dist.run(scriptfns.torchrun_main_then_helpers, nprocs=2, init_group=False) == pytest.approx(0.5)


@pytest.fixture
def two_simulated_cards(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEVERS9_SIMULATE_GPUS", "RTXPro6000:2")
    update_settings(multi_gpu=True)


@pytest.mark.timeout(180)
def test_classic_torchrun_main_inside_a_two_card_job(two_simulated_cards: None) -> None:
    out = job(gpu="RTXPro6000", gpu_count=2)(scriptfns.job_runs_classic_main).remote()
    assert out == {"rank": 0, "world": 2, "sum": 3.0, "elastic": True}


@pytest.mark.timeout(180)
def test_run_script_inside_a_two_card_job(two_simulated_cards: None, tmp_path: Path) -> None:
    job(gpu="RTXPro6000", gpu_count=2)(scriptfns.job_runs_script).remote(str(tmp_path))
    seen = {p.name: json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    assert sorted(seen) == ["rank0.json", "rank1.json"]
    assert seen["rank1.json"]["WORLD_SIZE"] == "2" and seen["rank1.json"]["argv"] == ["--out", str(tmp_path)]


@pytest.mark.timeout(120)
def test_run_script_gpu_word_counts_the_jobs_simulated_cards(two_simulated_cards: None, tmp_path: Path) -> None:
    job(gpu="RTXPro6000", gpu_count=2)(scriptfns.job_runs_script_on_every_card).remote(str(tmp_path))
    assert sorted(p.name for p in tmp_path.glob("rank*.json")) == ["rank0.json", "rank1.json"]


@pytest.mark.timeout(120)
def test_spawn_runs_the_ddp_tutorials_mp_spawn_worker(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    dist.spawn(scriptfns.tutorial_worker, args=(2, free_port(), str(out)), nprocs=2)
    assert sorted(p.read_text() for p in out.iterdir()) == ["1.0", "1.0"]


MP_SPAWN_CODE = """
import json, sys
import torch.multiprocessing as mp
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException
from levers9 import distributed as dist
from tests import scriptfns

def caught(spawn, fn, args):
    try:
        spawn(fn, args=args, nprocs=2)
    except ProcessRaisedException as e:
        return {"type": "raised", "index": e.error_index, "pid": e.error_pid, "text": str(e)}
    except ProcessExitedException as e:
        return {"type": "exited", "index": e.error_index, "pid": e.error_pid, "text": str(e), "exit_code": e.exit_code,
                "signal_name": e.signal_name}
    return None

if __name__ == "__main__":
    spawn = mp.spawn if sys.argv[1] == "mp.spawn" else dist.spawn
    print(json.dumps([caught(spawn, scriptfns.failing_worker, (1,)), caught(spawn, scriptfns.ending_worker, (1, "exit")),
                      caught(spawn, scriptfns.ending_worker, (1, "kill"))]))
"""


def _spawn_caller(code: str, spawner: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code, spawner], env=env, capture_output=True, text=True, timeout=150)


@pytest.mark.timeout(200)
def test_code_written_for_mp_spawn_catches_what_spawn_raises() -> None:
    """Side by side with torch.multiprocessing.spawn, code written for it (`except ProcessRaisedException`, reading
    .error_index, .error_pid, .exit_code, .signal_name) gets the same from levers9's spawn: a process that raised, its
    index, pid and traceback; one that exited or was killed, its exit code (negative for a signal) and the signal's
    name, in mp.spawn's words."""
    seen = {}
    for spawner in ("mp.spawn", "levers9 spawn"):
        done = _spawn_caller(MP_SPAWN_CODE, spawner)
        assert done.returncode == 0, done.stderr
        seen[spawner] = json.loads(done.stdout.splitlines()[-1])
    for raised, exited, killed in seen.values():
        assert (raised["type"], raised["index"]) == ("raised", 1) and raised["pid"] > 0
        assert "-- Process 1 terminated with the following error:" in raised["text"]
        assert 'raise KeyError(f"rank {rank} lost its config")' in raised["text"]
        assert (exited["type"], exited["index"], exited["exit_code"], exited["signal_name"]) == ("exited", 1, 3, None)
        assert exited["text"].startswith("process 1 terminated with exit code 3")
        assert (killed["type"], killed["index"], killed["exit_code"], killed["signal_name"]) == ("exited", 1, -9, "SIGKILL")
        assert killed["text"].startswith("process 1 terminated with signal SIGKILL")
    assert not any("distributed.run" in report["text"] for report in seen["levers9 spawn"])


@pytest.mark.timeout(120)
def test_what_spawn_raises_is_levers9s_failure_type_too() -> None:
    with pytest.raises(ProcessRaisedException) as raised:
        dist.spawn(scriptfns.failing_worker, args=(1,), nprocs=2)
    assert isinstance(raised.value, RankFailed) and raised.value.kind is FailureKind.EXCEPTION
    failure = raised.value.failure
    assert failure is not None and (failure.rank, failure.pid) == (raised.value.error_index, raised.value.error_pid)
    assert str(raised.value).count("KeyError: 'rank 1 lost its config'") == 1
    with pytest.raises(ProcessExitedException) as exited:
        dist.spawn(scriptfns.ending_worker, args=(1, "exit"), nprocs=2)
    assert isinstance(exited.value, RankCrashed) and exited.value.kind is FailureKind.EXIT


SPAWN_CALLER = """
import sys
import torch.multiprocessing as mp
from levers9 import distributed as dist
from tests import scriptfns

if __name__ == "__main__":
    spawn = mp.spawn if sys.argv[1] == "mp.spawn" else dist.spawn
    spawn(scriptfns.every_worker_raises, nprocs=2)
"""


@pytest.mark.timeout(200)
def test_a_spawn_that_fails_prints_each_processs_traceback_once_from_the_callers_line() -> None:
    """What reaches the console when every process raises (the DCP recipe's load without a checkpoint), side by
    side with mp.spawn: each process's traceback once (levers9 printed each twice, in 408 lines where mp.spawn
    printed 134), from the caller's line with one frame of levers9's, the one that raised (there were 10 to 13), and
    no more lines per failed process than mp.spawn's. mp.spawn reports the first process; levers9 each one that failed
    by itself."""
    printed = {}
    for spawner in ("mp.spawn", "levers9 spawn"):
        done = _spawn_caller(SPAWN_CALLER, spawner)
        printed[spawner] = done.stdout + done.stderr
        assert done.returncode == 1 and "ProcessRaise" in printed[spawner], printed[spawner]
    ours = printed["levers9 spawn"]
    failed = [rank for rank in (0, 1) if f"ValueError: bad shard on rank {rank}" in ours]
    assert failed, ours
    for rank in failed:
        assert ours.splitlines().count(f"ValueError: bad shard on rank {rank}") == 1, ours
    assert ours.count('raise ValueError(f"bad shard on rank {rank}")') == len(failed), ours
    assert len([line for line in ours.splitlines() if line.startswith("  File ") and "/levers9/" in line]) == 1, ours
    assert ours.splitlines()[1].startswith('  File "<string>", line 9, in <module>'), ours
    assert len(ours.splitlines()) <= len(printed["mp.spawn"].splitlines()) * len(failed), printed


def test_spawn_refuses_what_it_cannot_do() -> None:
    with pytest.raises(ConfigError, match="join=False"):
        dist.spawn(scriptfns.failing_worker, args=(1,), nprocs=2, join=False)
    with pytest.raises(ConfigError, match="nprocs=0"):
        dist.spawn(scriptfns.failing_worker, nprocs=0)


@pytest.mark.timeout(200)
def test_each_failing_ranks_traceback_is_printed_once_as_under_torchrun() -> None:
    """Every rank raises after init_process_group, whose excepthook prints the traceback with "[rankN]: " before each
    line: under torchrun that is the only copy; levers9 run printed it there and again in its report. Now its report
    is the one copy, for each rank that failed by itself."""
    script = str(SCRIPTS / "group_raises.py")
    for name, done in (("torchrun", torchrun("--nproc-per-node", "2", script, timeout=120)),
                       ("levers9 run", levers9_run("--nproc-per-node", "2", script, timeout=60))):  # fmt: skip
        assert done.returncode == 1, done.stderr[-3000:]
        copies = [len(re.findall(rf"^(\[rank {r}\] )?(\[rank{r}\]: )?ValueError: rank {r} could not load its shard$", done.stderr, re.M))
                  for r in (0, 1)]  # fmt: skip
        assert max(copies) == 1 and min(copies) <= 1, (name, copies, done.stderr[-3000:])
        if name == "torchrun":
            assert copies == [1, 1], done.stderr[-3000:]


@pytest.mark.timeout(60)
def test_run_script_raises_the_exit_code_of_a_rank() -> None:
    with pytest.raises(RankCrashed) as info:
        dist.run_script(str(SCRIPTS / "fail.py"), ["exit3"], nprocs=2)
    assert info.value.failure is not None and info.value.failure.exitcode == 3


OTHER_COMMANDS = ("levers9.doctor", "levers9.launch.workspace_cli", "levers9.launch.runs_cli", "levers9.launch.ray_cli",
                  "levers9.stacks_cli", "levers9.launch.settings", "tomlkit")  # fmt: skip


def test_levers9_run_loads_no_other_subcommand_and_help_still_names_them_all() -> None:
    """Before, every `levers9 run` imported all six subcommands' modules (the workspace settings and tomlkit,
    doctor's, the run records') before its ranks started: about 0.09 s of a 1.6 s 2-rank job here."""
    code = ("import atexit, sys\n"
            f"atexit.register(lambda: print(sorted(m for m in sys.modules if m in {OTHER_COMMANDS!r})))\n"
            "from levers9.cli import main\nmain(['-v', 'run', '--nproc-per-node', '2', '--help'])")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "[]", done.stdout[-2000:] + done.stderr
    names = ("workspace", "doctor", "stacks", "ray", "runs", "run")
    helped = subprocess.run([sys.executable, "-m", "levers9", "--help"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and all(f"\n    {name} " in helped.stdout for name in names), helped.stdout
    unknown = subprocess.run([sys.executable, "-m", "levers9", "rnu"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60)
    listed = unknown.stderr.partition("choose from")[2]  # argparse quotes the names on some Pythons, not others
    assert unknown.returncode == 2 and all(re.search(rf"\b{name}\b", listed) for name in names), unknown.stderr
