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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked `ray` run last: the session's Ray starts with the first of them, so its dozen idle
    processes do not share this machine's two cores with the rest of the suite."""
    items.sort(key=lambda item: item.get_closest_marker("ray") is not None)


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
