"""@job's arguments and map cells: every bad input is a clear error, raised before anything starts."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest

from levers9.errors import InfeasibleJobError, JobConfigError, NotShippableError, WorkspacePolicyError
from levers9.launch import Retries, job
from levers9.launch.cells import expand, make_cells
from levers9.launch.pool import simulated_pool
from levers9.launch.settings import load_settings
from levers9.launch.spec import build_spec, check_feasible, check_policy
from tests import jobfns

pytestmark = pytest.mark.fast


def spec(**kw: object) -> object:
    args: dict[str, object] = dict(
        name="f", gpu=None, gpu_count=None, timeout=None, retries=0, env=None, cpu=None, memory=None,
        queue_timeout=None, stop_grace=10.0, stream_output=True,
    )  # fmt: skip
    args.update(kw)
    return build_spec(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gpu": "RTXPro600"}, "Did you mean 'RTXPro6000'"),
        ({"gpu": "RTXPro6000", "gpu_count": True}, "gpu_count must be an int, got bool"),
        ({"gpu": "RTXPro6000", "gpu_count": 2.0}, "gpu_count must be an int, got float 2.0"),
        ({"gpu": "RTXPro6000", "gpu_count": 0}, "gpu_count=0 asks for a card type but no cards"),
        ({"gpu": "RTXPro6000", "gpu_count": -1}, "gpu_count must be 0 or more"),
        ({"gpu": "H100:8", "gpu_count": 4}, "already asks for 8 cards but gpu_count=4"),
        ({"gpu": "H100:x"}, "Invalid GPU count in gpu='H100:x'"),
        ({"gpu": []}, "gpu=None for a CPU job"),
        ({"gpu": ["any", "H100"]}, "'any' must be used alone"),
        ({"env": {"EPOCHS": 3}}, "env['EPOCHS'] must be a str, got int 3"),
        ({"env": {"CUDA_VISIBLE_DEVICES": "0"}}, "env may not set CUDA_VISIBLE_DEVICES"),
        ({"env": {"LEVERS9_X": "1"}}, "env may not set LEVERS9_X"),
        ({"env": {"1BAD": "x"}}, "not a valid environment variable name"),
        ({"timeout": 0}, "timeout must be a positive number of seconds"),
        ({"timeout": -5}, "timeout must be a positive number of seconds"),
        ({"timeout": "1h"}, "timeout must be a positive number of seconds"),
        ({"stall_timeout": 0}, "stall_timeout must be a positive number of seconds"),
        ({"stall_timeout": "1m"}, "stall_timeout must be a positive number of seconds"),
        ({"retries": -1}, "retries must be an int from 0 to 10"),
        ({"retries": 11}, "retries must be an int from 0 to 10"),
        ({"cpu": 0}, "cpu must be a number of cores"),
        ({"memory": "lots"}, "memory must be MiB"),
        ({"memory": 0}, "memory must be greater than 0"),
    ],
)
def test_bad_job_arguments_are_refused_with_the_fix(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(JobConfigError, match=re.escape(message)):
        job(**kwargs)(jobfns.add)  # type: ignore[call-overload]


def test_good_job_arguments_normalise() -> None:
    assert spec(gpu="rtx-pro-6000").gpu_types == ("RTXPro6000",)  # type: ignore[attr-defined]
    assert spec(gpu="rtx-pro-6000").gpu_count == 1  # type: ignore[attr-defined]
    assert spec(gpu="H100:8").gpu_count == 8  # type: ignore[attr-defined]
    assert spec(gpu_count=2).gpu_types == ()  # type: ignore[attr-defined]  # any type
    assert spec(gpu="any").gpu_types == ()  # type: ignore[attr-defined]
    assert spec().gpu_count == 0  # type: ignore[attr-defined]
    assert spec(memory="64Gi").memory_mib == 65536  # type: ignore[attr-defined]
    assert spec(cpu="500m").cpu == 0.5  # type: ignore[attr-defined]
    assert spec(retries=2).retries == Retries(2)  # type: ignore[attr-defined]


def test_retries_backoff() -> None:
    r = Retries(3, backoff_coefficient=2.0, initial_delay=1.0, max_delay=3.0)
    assert [r.delay(a) for a in (2, 3, 4)] == [1.0, 2.0, 3.0]
    with pytest.raises(JobConfigError, match="on="):
        Retries(1, on=("crash", "sometimes"))


def test_classes_generators_and_async_functions_are_refused() -> None:
    class Model:
        pass

    def gen() -> object:
        yield 1

    async def coro() -> None:
        pass

    for target, message in ((Model, "not classes"), (gen, "generator"), (coro, "async")):
        with pytest.raises(JobConfigError, match=message):
            job(target)  # type: ignore[arg-type]


def test_cells_expand_tuple_dict_else_one_argument() -> None:
    assert expand((1, 2)) == ((1, 2), {})
    assert expand({"a": 1}) == ((), {"a": 1})
    assert expand([1, 2]) == (([1, 2],), {})  # a list is one argument
    assert expand("x") == (("x",), {})


def test_every_cell_is_checked_before_any_starts() -> None:
    with pytest.raises(
        JobConfigError, match=r"cell #2 \(1, 2, 3\) does not fit add\(a, b=0\): too many positional"
    ):
        make_cells(jobfns.add, [(1,), (1, 2), (1, 2, 3)])
    with pytest.raises(JobConfigError, match="cell #1"):
        make_cells(jobfns.add, [{"a": 1}, {"c": 2}])
    with pytest.raises(NotShippableError, match=r"cell #1: argument 0 = .*lock.*cannot be pickled"):
        make_cells(jobfns.add, [1, threading.Lock()])


def test_bad_map_starts_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LEVERS9_SIMULATE_GPUS", "RTXPro6000:4")
    out = tmp_path / "pids"
    out.mkdir()
    fn = job(gpu="RTXPro6000")(jobfns.pid_and_sleep)
    with pytest.raises(JobConfigError, match="cell #1"):
        fn.map([(str(out), 0, 0), (str(out),)])
    with pytest.raises(JobConfigError):
        fn.remote(str(out))
    assert list(out.iterdir()) == []
    assert not (tmp_path / "levers9-state" / "runs").exists()  # not even a log folder


def test_policy_cap_then_switch() -> None:
    settings = load_settings()
    assert settings.multi_gpu is False and settings.max_gpu_count == 8
    with pytest.raises(
        WorkspacePolicyError, match=r"GPU count must be 8 or less .*levers9 workspace max-gpu-count 16"
    ):
        check_policy(spec(gpu="H100", gpu_count=16), settings)  # type: ignore[arg-type]
    with pytest.raises(WorkspacePolicyError, match=r"asks for 2 cards.*levers9 workspace multi-gpu on"):
        check_policy(spec(gpu="H100", gpu_count=2), settings)  # type: ignore[arg-type]
    check_policy(spec(gpu="H100", gpu_count=1), settings)  # type: ignore[arg-type]


def test_feasibility_names_what_the_machine_has() -> None:
    pool = simulated_pool("RTXPro6000:4,H100:2")
    assert check_feasible(spec(gpu="H100", gpu_count=2), pool) == [[4, 5]]  # type: ignore[arg-type]
    assert check_feasible(spec(gpu_count=3), pool) == [[0, 1, 2, 3], [4, 5]]  # type: ignore[arg-type]
    with pytest.raises(InfeasibleJobError, match=r"largest group .* has 2 .*4× RTXPro6000, 2× H100"):
        check_feasible(spec(gpu="H100", gpu_count=4), pool)  # type: ignore[arg-type]
    with pytest.raises(InfeasibleJobError, match="use gpu='RTXPro6000' or gpu='any'"):
        check_feasible(spec(gpu="A100-80"), simulated_pool("RTXPro6000:4"))  # type: ignore[arg-type]


def test_no_cards_and_no_simulation_is_an_error_not_a_cpu_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")  # and no nvidia-smi either
    fn = job(gpu="RTXPro6000")(jobfns.add)
    with pytest.raises(InfeasibleJobError, match="LEVERS9_SIMULATE_GPUS"):
        fn.remote(1)


def test_bad_simulated_pool_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEVERS9_SIMULATE_GPUS", "RTXPro6000:four")
    with pytest.raises(JobConfigError, match="LEVERS9_SIMULATE_GPUS"):
        job(gpu="RTXPro6000")(jobfns.add).remote(1)


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(JobConfigError, match=r"Unknown backend 'kubernetes'.*Expected one of: local, ray, slurm"):
        job(backend="kubernetes")(jobfns.add)
