"""A job started from inside a job never waits forever: it runs on the cards its caller holds (the
caller is blocked on it anyway), or fails at once naming the deadlock and the fix. Locally and on Ray."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from levers9.distributed.hardware import cards
from levers9.errors import InfeasibleJobError
from levers9.launch import job
from levers9.launch.settings import update_settings
from tests import jobfns, ray_cluster
from tests.fakes import use_fake_pynvml
from tests.fakes.machines import RTX_PRO_6000_SERVER, machine

pytestmark = pytest.mark.procs


@pytest.fixture
def two_cards(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEVERS9_SIMULATE_GPUS", "RTXPro6000:2")


@pytest.mark.timeout(60)
def test_a_two_cell_map_whose_cells_start_gpu_jobs_runs_them_on_the_callers_cards(two_cards: None) -> None:
    outer = job(gpu="RTXPro6000", stream_output=False)(jobfns.nested_remote)
    results = list(outer.map(["a", "b"]))  # both cards are held by the outer cells while they wait
    assert sorted(r["outer"] for r in results) == ["0", "1"]
    for r in results:
        assert r["inner"]["cards"] == r["outer"] and r["inner"]["simulated"] is True
    assert [r["inner"]["tag"] for r in results] == ["a", "b"]


@pytest.mark.timeout(60)
def test_a_map_inside_a_job_shares_the_callers_cards_among_its_cells(two_cards: None) -> None:
    update_settings(multi_gpu=True)
    outer = job(gpu="RTXPro6000", gpu_count=2, stream_output=False)(jobfns.nested_map)
    result = outer.remote(4)
    inner = result["inner"]
    assert result["outer"] == "0,1"
    assert sorted(r["cards"] for r in inner) == ["0", "0", "1", "1"]
    for card in "01":  # two cells on one card never overlap: the caller's cards are leased to them
        a, b = sorted((r for r in inner if r["cards"] == card), key=lambda r: r["start"])
        assert a["end"] <= b["start"]


@pytest.mark.timeout(60)
def test_an_inner_job_bigger_than_its_callers_cards_fails_at_once(two_cards: None) -> None:
    update_settings(multi_gpu=True)
    outer = job(gpu="RTXPro6000", stream_output=False)(jobfns.nested_remote)
    start = time.monotonic()
    with pytest.raises(InfeasibleJobError) as info:
        outer.remote("big", None, 2)
    text = str(info.value)
    assert "asks for 2 RTXPro6000 cards" in text and "started inside job" in text and "holds 1× RTXPro6000" in text
    assert "deadlock" in text and "start the inner jobs from the top-level script" in text
    assert time.monotonic() - start < 20


@pytest.mark.timeout(60)
def test_on_real_cards_nested_jobs_run_on_the_callers_cards(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    request.addfinalizer(cards.clear_cache)  # the fake machine must not outlive this test
    use_fake_pynvml(monkeypatch, machine(*[RTX_PRO_6000_SERVER] * 2))
    outer = job(gpu="RTXPro6000", stream_output=False)(jobfns.nested_remote)
    results = list(outer.map(["a", "b"]))
    assert sorted(r["outer"] for r in results) == ["0", "1"]
    for r in results:
        assert r["inner"]["cards"] == r["outer"] and r["inner"]["simulated"] is False


@pytest.fixture
def on_ray(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    address = ray_cluster.address(request.config)
    monkeypatch.setenv("RAY_ADDRESS", address)
    update_settings(multi_gpu=True)
    yield address


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_on_ray_a_task_holding_every_gpu_runs_its_inner_gpu_job_on_its_own_cards(on_ray: str) -> None:
    # two tasks of 2 logical GPUs each hold all 4 of the cluster's; each starts a 1-GPU Ray job inside
    outer = job(gpu="RTXPro6000", gpu_count=2, backend="ray", stream_output=False)(jobfns.nested_remote)
    results = list(outer.map([("a", "ray"), ("b", "ray")]))
    for r in results:
        assert r["inner"]["cards"] in r["outer"].split(",")
    assert os.environ["RAY_ADDRESS"] == on_ray
