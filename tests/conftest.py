"""Shared test set-up: every test starts from a clean, launcher-free environment."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

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


# Test tiers (CONTRIBUTING.md): every test gets exactly one of these markers, by its module, so that
# `pytest -m fast` runs the pure tests in seconds and `-m "not ray"` skips the session's Ray.
#   fast       pure: no process started, no launcher, no Ray (detection, quirk plans on fake hardware,
#              specs, settings, policy, world of one, failure-kind tables)
#   procs      starts processes (ranks, jobs, forked children, the CLI as a subprocess)
#   launchers  runs torchrun, accelerate launch or `levers9 run` as subprocesses, side by side
#   notebook   runs a Jupyter kernel
#   ray        uses the session's local Ray (tests/ray_cluster.py); last, or on a worker of their own with -n
TIERS = ("fast", "procs", "launchers", "notebook", "ray")
# A module not named here is "procs" (the safe guess for a new test file: it is not in the fast tier).
TIER_BY_MODULE = {
    "test_cards": "fast",
    "test_detect": "fast",
    "test_gpu_types": "fast",
    "test_launch_settings": "fast",
    "test_launch_spec": "fast",
    "test_quirks": "fast",
    "test_world_of_one": "fast",
    "test_failure_kinds": "fast",
    "test_docs": "procs",
    "test_nccl": "procs",  # each test reads the fake NCCL in a fresh interpreter
    "test_examples": "launchers",
    "test_run_everywhere": "launchers",
    "test_run_script": "launchers",
    "test_terminate": "launchers",
    "test_transparent": "launchers",
    "test_contract": "launchers",
    "test_notebook": "notebook",
    "test_ray_backend": "ray",
    "test_ray_nodes": "ray",
}
# Tests whose tier is not their module's: (module, test name prefix) -> tier. Pure tests in modules that
# mostly start processes, and tests of "fast" modules that start a process.
TIER_BY_TEST = {
    ("test_restarts", "test_restart_count_reads_torchruns_variable"): "fast",
    ("test_restarts", "test_job_max_restarts_is_checked_at_decoration"): "fast",
    ("test_restarts", "test_each_failure_is_classified_by_what_a_restart_can_cure"): "fast",
    ("test_stalls", "test_stall_rule"): "fast",
    ("test_restarts", "test_bad_restart_arguments_are_refused_before_anything_starts"): "fast",
    ("test_restarts", "test_restart_arguments_are_refused_under_a_launcher"): "fast",
    ("test_run", "test_bad_arguments_are_refused_before_anything_starts"): "fast",
    ("test_run", "test_not_a_function_is_refused"): "fast",
    ("test_run", "test_a_bad_pg_timeout_variable_is_refused_by_name"): "fast",
    ("test_sweeps", "test_unknown_order_is_refused_before_anything_starts"): "fast",
    ("test_sweeps", "test_retention_keeps_what_it_promises"): "fast",
    ("test_oom", "test_the_cgroup_is_found_through_proc_and_the_mount_table"): "fast",
    ("test_oom", "test_without_a_readable_counter_no_oom_claim_is_made"): "fast",
    ("test_nccl", "test_decode_version_both_encodings"): "fast",
    ("test_cards", "test_without_a_driver_pynvml_is_not_even_imported"): "procs",
    ("test_launch_settings", "test_cli_"): "procs",
    ("test_quirks", "test_apply_"): "procs",
}


# Tests that must share one pytest-xdist worker when the suite runs on several (`-n 3 --dist loadgroup`), by
# (module, test name prefix; "" for the whole module) -> group:
#   port-29500  torchrun without --standalone and `accelerate launch` rendezvous on the default port, so
#               two at once on one machine would collide (as they would for a user)
#   ray         the session's one Ray (tests/ray_cluster.py) and the two-node cluster of test_ray_nodes,
#               which shuts that one down first: one worker runs them all, one after another
#   notebook    one kernel per scenario, shared by the module's tests (a module-scoped fixture)
XDIST_GROUP_BY_TEST = {
    ("test_contract", ""): "port-29500",
    ("test_examples", "test_torchrun_script"): "port-29500",
    ("test_examples", "test_accelerate_script"): "port-29500",
    ("test_examples", "test_existing_ddp_script"): "port-29500",
    ("test_run_everywhere", "test_timeout_under_torchrun"): "port-29500",
    ("test_run_script", "test_torchrun_code_inside_distributed_run_under_a_launcher[accelerate]"): "port-29500",
    ("test_notebook", ""): "notebook",
}


def _by_test(item: pytest.Item, table: dict[tuple[str, str], str]) -> str | None:
    """The value `table` gives one collected test by (module, test name prefix), else None."""
    module = item.module.__name__.rpartition(".")[2] if getattr(item, "module", None) else ""
    return next((value for (mod, prefix), value in table.items() if mod == module and item.name.startswith(prefix)), None)


def xdist_group_of(item: pytest.Item, tier: str) -> str | None:
    """The pytest-xdist group of one test (None: any worker may run it)."""
    return "ray" if tier == "ray" else _by_test(item, XDIST_GROUP_BY_TEST)


def tier_of(item: pytest.Item) -> str:
    """The tier of one collected test: `ray` if marked so, else by test name, else by module."""
    if item.get_closest_marker("ray") is not None:
        return "ray"
    module = item.module.__name__.rpartition(".")[2] if getattr(item, "module", None) else ""
    return _by_test(item, TIER_BY_TEST) or TIER_BY_MODULE.get(module, "procs")


# The order tests run in, by tier: the costly ones first, so that with several workers the short ones fill the
# end, and `ray` last. A process that has run `ray.init` must start nothing by fork afterwards (Ray's gRPC state
# and its SIGSEGV handler are copied into the child, which then crashes or reports a crash in Ray's words): a
# run without workers runs the Ray tests after everything else, and with workers they run on a worker of
# their own (tests/xdist_schedule.py).
RUN_ORDER = ("launchers", "notebook", "procs", "fast", "ray")


def mark_tiers(items: list[pytest.Item]) -> None:
    """Give every test its tier's marker and its xdist group, and sort them all by RUN_ORDER."""
    for item in items:
        tier = tier_of(item)
        if item.get_closest_marker(tier) is None:
            item.add_marker(getattr(pytest.mark, tier))
        group = xdist_group_of(item, tier)
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: RUN_ORDER.index(tier_of(item)))


# First among the hooks: a pytest-xdist worker turns each test's xdist_group marker into its group in its own
# pytest_collection_modifyitems, which must see the markers given here (tests/test_xdist_schedule.py). The
# compat tests' conftest registers this same hook; marking twice changes nothing.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mark_tiers(items)


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
