"""The Ray backend beyond the shared contract: feasibility against the alive nodes, GPU-type routing,
ranks inside a multi-card task, backend selection, `levers9 ray node-args`, and Ray staying optional.

Jobs run on the session's one local Ray (tests/ray_cluster.py: 4 logical GPUs declared as
levers9_RTXPro6000, 2 CPUs). The feasibility rules are also checked as a pure function over node
descriptions, for clusters this box cannot start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import levers9
from levers9.cli import main as cli_main
from levers9.errors import InfeasibleJobError
from levers9.launch import job
from levers9.launch.settings import runs_dir, update_settings
from levers9.launch.spec import build_spec
from tests import jobfns, ray_cluster
from tests.fakes import use_fake_pynvml
from tests.fakes.machines import H100, RTX_PRO_6000_SERVER, machine

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.ray


@pytest.fixture
def on_ray(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """RAY_ADDRESS of the session's Ray, with the multi-GPU switch on."""
    address = ray_cluster.address(request.config)
    monkeypatch.setenv("RAY_ADDRESS", address)
    update_settings(multi_gpu=True)
    yield address


def spec(**kwargs: Any) -> Any:
    args: dict[str, Any] = dict(
        name="cell", gpu=None, gpu_count=None, timeout=None, retries=0, env=None, cpu=None, memory=None,
        queue_timeout=None, stop_grace=10.0, stream_output=True,
    )  # fmt: skip
    args.update(kwargs)
    return build_spec(**args)


def node(address: str, **resources: float) -> Any:
    from levers9.launch.ray.gang import Node

    return Node(address, {"CPU": 16.0, **resources})


# ---- feasibility and routing as a pure function of the alive nodes ----------------------------------


def test_a_typed_job_asks_for_its_type_resource_and_no_cpu() -> None:
    from levers9.launch.ray.backend import plan_job

    nodes = [node("10.0.0.1", GPU=8, levers9_H100=8), node("10.0.0.2", GPU=4, levers9_RTXPro6000=4)]
    plan = plan_job(spec(gpu="RTXPro6000", gpu_count=2), nodes)
    assert (plan.num_gpus, plan.num_cpus, plan.resources) == (2, 0.0, {"levers9_RTXPro6000": 2.0})
    # a list of types is an order of preference: the first that some node could hold
    plan = plan_job(spec(gpu=["B200", "H100"], gpu_count=8), nodes)
    assert plan.resources == {"levers9_H100": 8.0} and plan.gpu_type == "H100"
    # any type: GPUs only
    assert plan_job(spec(gpu="any", gpu_count=8), nodes).resources == {}
    # a CPU job takes one core unless cpu= says otherwise
    assert plan_job(spec(), nodes).num_cpus == 1.0
    assert plan_job(spec(cpu=4), nodes).num_cpus == 4.0


def test_no_node_could_hold_it_names_the_largest_node() -> None:
    from levers9.launch.ray.backend import plan_job

    nodes = [node("10.0.0.1", GPU=2, levers9_H100=2), node("10.0.0.2", GPU=4, levers9_RTXPro6000=4)]
    with pytest.raises(InfeasibleJobError, match=r"largest node is 10\.0\.0\.2 with 4× RTXPro6000"):
        plan_job(spec(gpu="RTXPro6000", gpu_count=8), nodes)
    # more H100 than the H100 node has, although another node has more GPUs of another type
    with pytest.raises(InfeasibleJobError, match=r"needs 4 H100 cards at once on one node"):
        plan_job(spec(gpu="H100", gpu_count=4), nodes)
    with pytest.raises(InfeasibleJobError, match="no alive Ray node could ever hold it"):
        plan_job(spec(gpu="B200"), nodes)
    with pytest.raises(InfeasibleJobError, match="has no alive node"):
        plan_job(spec(gpu="H100"), [])
    with pytest.raises(InfeasibleJobError, match="needs 32 CPU"):
        plan_job(spec(cpu=32), nodes)


# ---- on the session's Ray ----------------------------------------------------------------------------


def test_infeasible_job_fails_at_once_naming_the_largest_node(on_ray: str) -> None:
    too_many = job(gpu="RTXPro6000", gpu_count=8, backend="ray")(jobfns.report)
    started = time.monotonic()
    with pytest.raises(InfeasibleJobError, match=r"largest node is \S+ with 4× RTXPro6000, 2 CPU"):
        too_many.remote("x", 0)
    assert time.monotonic() - started < 5
    assert not runs_dir().exists() or not any(runs_dir().iterdir()), "nothing may start"


def test_gpu_type_routing(on_ray: str) -> None:
    import ray

    missing = job(gpu="H100", backend="ray")(jobfns.report)
    started = time.monotonic()
    with pytest.raises(InfeasibleJobError, match="1 H100 card"):
        missing.remote("x", 0)
    assert time.monotonic() - started < 5
    typed = job(gpu="RTXPro6000", gpu_count=2, backend="ray")(typed_report)
    result = typed.remote()
    assert result["type"] == "RTXPro6000" and len(result["cards"].split(",")) == 2
    (meta_path,) = runs_dir().glob("*/0000-1/meta.json")
    landed = json.loads(meta_path.read_text())["node_id"]
    holders = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("levers9_RTXPro6000")]
    assert landed in holders


def typed_report() -> dict[str, Any]:
    return {
        "type": levers9.current_job().gpu_type,  # type: ignore[union-attr]
        "cards": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def two_ranks(cfg: dict[str, Any]) -> dict[str, Any]:
    """A rank inside a 2-card job: its world, the mean of the ranks (0.5 needs both), its backend."""
    import torch.distributed as torch_dist

    from levers9 import distributed as dist

    return {
        "world_size": dist.world_size(),
        "rank": dist.rank(),
        "mean_rank": float(dist.all_reduce_mean(float(dist.rank()))),
        "backend": torch_dist.get_backend(),
        "cards": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "simulated": levers9.current_job().simulated,  # type: ignore[union-attr]
    }


def run_two_ranks() -> Any:
    from levers9 import distributed as dist

    return dist.run(two_ranks, {})


def test_a_two_gpu_job_runs_two_gloo_ranks(on_ray: str) -> None:
    fn = job(gpu="RTXPro6000", gpu_count=2, timeout=120, backend="ray")(run_two_ranks)
    result = fn.remote()
    assert result["world_size"] == 2 and result["rank"] == 0
    assert result["mean_rank"] == 0.5 and result["backend"] == "gloo"
    assert result["simulated"] is True


def test_levers9_backend_variable_selects_ray(on_ray: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # No LEVERS9_SIMULATE_GPUS and no card here: locally this job could never run.
    monkeypatch.setenv("LEVERS9_BACKEND", "ray")
    fn = job(gpu="RTXPro6000")(jobfns.report)
    assert fn.remote("env", 0)["cards"] in {"0", "1", "2", "3"}
    monkeypatch.setenv("LEVERS9_BACKEND", "local")
    with pytest.raises(InfeasibleJobError, match="no NVIDIA GPU"):
        fn.remote("env", 0)


# ---- levers9 ray node-args ---------------------------------------------------------------------------


def test_node_args_from_real_card_names(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    use_fake_pynvml(monkeypatch, machine(*[RTX_PRO_6000_SERVER] * 4, H100, H100))
    assert cli_main(["ray", "node-args"]) == 0
    assert capsys.readouterr().out.strip() == (
        '--num-gpus=6 --resources=\'{"levers9_H100":2,"levers9_RTXPro6000":4}\''
    )
    assert cli_main(["ray", "node-args", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "num_gpus": 6,
        "resources": {"levers9_H100": 2, "levers9_RTXPro6000": 4},
    }
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")  # what this process may use
    assert cli_main(["ray", "node-args", "--unquoted"]) == 0
    assert capsys.readouterr().out.strip() == '--num-gpus=2 --resources={"levers9_H100":2}'


def test_node_args_with_simulated_cards_and_with_none(capfd: pytest.CaptureFixture[str]) -> None:
    env = {**os.environ, "LEVERS9_SIMULATE_GPUS": "rtx pro 6000:2"}
    out = subprocess.run(
        [sys.executable, "-m", "levers9", "ray", "node-args"], env=env, capture_output=True, text=True
    )
    assert (
        out.returncode == 0 and out.stdout.strip() == "--num-gpus=2 --resources='{\"levers9_RTXPro6000\":2}'"
    )
    bad = subprocess.run(
        [sys.executable, "-m", "levers9", "ray", "node-args"],
        env={**os.environ, "LEVERS9_SIMULATE_GPUS": "RTXPro6000:x"},
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 1 and "LEVERS9_SIMULATE_GPUS" in bad.stderr


def test_no_cards_means_zero_gpus_and_a_hint(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    use_fake_pynvml(monkeypatch, machine())
    assert cli_main(["ray", "node-args"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == "--num-gpus=0" and "no NVIDIA card" in captured.err


# ---- Ray stays optional ------------------------------------------------------------------------------


def test_importing_levers9_does_not_import_ray() -> None:
    code = (
        "import sys, levers9, levers9.launch, levers9.distributed, levers9.launch.ray.resources, levers9.cli\n"
        "levers9.cli.build_parser()\n"
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"
