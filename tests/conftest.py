"""Shared test set-up: every test starts from a clean, launcher-free environment."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import slurm_cluster

# Variables that launchers, schedulers, GPUs or levers9 itself set; none may leak from one test to the next.
LAUNCHER_PREFIXES = (
    "TORCHELASTIC_",
    "ACCELERATE_",
    "SLURM_",
    "OMPI_",
    "PMI_",
    "PMIX_",
    "MPI_LOCAL",
    "LEVERS9_",
    "MASTER_",
)
LAUNCHER_NAMES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "NODE_RANK",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "NCCL_P2P_DISABLE",
    "NCCL_SHM_DISABLE",
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
    "RAY_ADDRESS",
)


# Test tiers (CONTRIBUTING.md): every test has exactly one of these markers, written on the test itself, so that
# `pytest -m fast` runs the pure tests in seconds and `-m "not ray"` skips the session's Ray. A module says its
# tier once (`pytestmark = pytest.mark.procs`); a test (or a parameter) that differs carries its own marker,
# which replaces the module's for that test.
#   fast       pure: no process started, no launcher, no Ray (detection, quirk plans on fake hardware,
#              specs, settings, policy, world of one, failure-kind tables)
#   procs      starts processes (ranks, jobs, forked children, the CLI as a subprocess)
#   launchers  runs torchrun, accelerate launch or `levers9 run` as subprocesses, side by side
#   notebook   runs a Jupyter kernel
#   ray        uses the session's local Ray (tests/ray_cluster.py); last, or on a worker of their own with -n
#   slurm      uses the real two-node SLURM of compat_tests/slurm_cluster.sh (tests/slurm_cluster.py)
# Tests that must share one pytest-xdist worker when the suite runs on several (`-n 3 --dist loadgroup`) say so
# with `pytest.mark.xdist_group(...)` too; every `ray` test is in the group "ray":
#   port-29500  torchrun without --standalone and `accelerate launch` rendezvous on the default port, so
#               two at once on one machine would collide (as they would for a user)
#   ray         the session's one Ray (tests/ray_cluster.py) and the two-node cluster of test_ray_nodes,
#               which shuts that one down first: one worker runs them all, one after another
#   notebook    one kernel per scenario, shared by the module's tests (a module-scoped fixture)
TIERS = ("fast", "procs", "launchers", "notebook", "ray", "slurm")


def _take_tiers(module: pytest.Module) -> list[str]:
    """The tiers `module`'s pytestmark names, taken off the module: they become its tests' own markers, so that
    `-m` sees the one a test ends with and never the module's beside a test's own."""
    tiers = [mark.name for mark in module.own_markers if mark.name in TIERS]
    module.own_markers[:] = [mark for mark in module.own_markers if mark.name not in TIERS]
    return tiers


def tier_of(item: pytest.Item) -> str:
    """The tier of one collected test, after mark_tiers: its one tier marker."""
    return next(mark.name for mark in item.iter_markers() if mark.name in TIERS)


# The order tests run in, by tier: the costly ones first, so that with several workers the short ones fill the
# end, and `ray` last. A process that has run `ray.init` must start nothing by fork afterwards (Ray's gRPC state
# and its SIGSEGV handler are copied into the child, which then crashes or reports a crash in Ray's words): a
# run without workers runs the Ray tests after everything else, and with workers they run on a worker of
# their own (tests/xdist_schedule.py).
RUN_ORDER = ("launchers", "slurm", "notebook", "procs", "fast", "ray")


def mark_tiers(items: list[pytest.Item]) -> None:
    """Give every test its one tier marker (its own, else its module's), the `ray` tests their xdist group, and
    sort them all by RUN_ORDER; a test with no tier, or more than one, fails the collection."""
    of_module: dict[str, list[str]] = {}
    for item in items:
        module = item.getparent(pytest.Module)
        if module is not None and module.nodeid not in of_module:
            of_module[module.nodeid] = _take_tiers(module)
    wrong = []
    for item in items:
        module = item.getparent(pytest.Module)
        own = list(dict.fromkeys(mark.name for mark in item.iter_markers() if mark.name in TIERS))
        tiers = own or (of_module.get(module.nodeid, []) if module is not None else [])
        if len(tiers) != 1:
            wrong.append(f"{item.nodeid}: {'no tier' if not tiers else 'tiers ' + ', '.join(tiers)}")
            continue
        if not own:
            item.add_marker(getattr(pytest.mark, tiers[0]))
        if tiers[0] == "ray" and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group("ray"))
    if wrong:
        raise pytest.UsageError(
            "every test needs exactly one tier marker, from " + ", ".join(TIERS) + "; these have none or several:\n  "
            + "\n  ".join(wrong) + "\nGive the module one (`pytestmark = pytest.mark.procs`), or the test its own "
            "(`@pytest.mark.fast`) in place of the module's (tests/conftest.py: TIERS)."
        )
    items.sort(key=lambda item: RUN_ORDER.index(tier_of(item)))


# First among the hooks: a pytest-xdist worker turns each test's xdist_group marker into its group in its own
# pytest_collection_modifyitems, which must see the markers given here (tests/test_xdist_schedule.py). The
# compat tests' conftest registers this same hook; marking twice changes nothing.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mark_tiers(items)


def pytest_configure(config: pytest.Config) -> None:
    """The controller fixes the run's id before it starts its workers (tests/slurm_cluster.py)."""
    if not hasattr(config, "workerinput"):
        slurm_cluster.run_id(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    """The controller, once every worker is done, stops the SLURM cluster if a process of this run started it."""
    if not hasattr(config, "workerinput"):
        slurm_cluster.stop_if_started_here(config)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """With `--dist loadgroup`, the Ray group starts first, on a worker of its own (tests/xdist_schedule.py)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from tests.xdist_schedule import RayApartScheduling

    return RayApartScheduling(config, log)


def strip_launcher_env(env: dict[str, str] | os._Environ[str]) -> None:
    """Remove every launcher variable from `env` in place."""
    for key in list(env):
        if key in LAUNCHER_NAMES or key.startswith(LAUNCHER_PREFIXES):
            del env[key]


@pytest.fixture(autouse=True)
def clean_launcher_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """Strip launcher variables and aim levers9's config and state at this test's tmp dir."""
    for key in list(os.environ):
        if key in LAUNCHER_NAMES or key.startswith(LAUNCHER_PREFIXES):
            monkeypatch.delenv(key)
    config = tmp_path / "levers9-config"
    config.mkdir()
    monkeypatch.setenv("LEVERS9_CONFIG_DIR", str(config))
    monkeypatch.setenv("LEVERS9_STATE_DIR", str(tmp_path / "levers9-state"))
    # torch makes inductor's cache folder whenever DDP or torch.compile is first used: in the test's
    # folder, not /tmp/torchinductor_<user> (ranks and launched scripts inherit this)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torchinductor"))
    yield
    forget_fake_hardware()


def forget_fake_hardware() -> None:
    """Drop a fake pynvml a test imported and the card inventory read through it, so no later test sees them."""
    from levers9.distributed.hardware import cards

    module = sys.modules.get("pynvml")
    if module is not None and f"{os.sep}fakes{os.sep}" in (getattr(module, "__file__", "") or ""):
        del sys.modules["pynvml"]
    cards.clear_cache()
