"""The session's SLURM: the real two-node cluster of compat_tests/slurm_cluster.sh (2 nodes x 2 GRES cards).

Started on first use (when it is not running already, as in CI, which starts it before pytest) and
stopped when pytest ends if this session started it. Where it cannot run (not root, slurm-wlm or munge
not installed, a daemon that does not come up), the `slurm` tests are skipped with the reason printed on
the terminal, never silently. A module-level singleton, as tests/ray_cluster.py, keeps it to one start.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "compat_tests" / "slurm_cluster.sh"
_state: dict[str, str] = {}


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=180)


def slurm_conf(config: pytest.Config) -> str:
    """SLURM_CONF of the running cluster, started now if needed; pytest.skip with a printed reason if it cannot be."""
    if "skip" in _state:
        pytest.skip(_state["skip"])
    if "conf" in _state:
        return _state["conf"]
    reason = None
    if os.geteuid() != 0:
        reason = f"the SLURM tests need root to start the cluster daemons (uid {os.geteuid()}): run pytest as root"
    elif not (shutil.which("slurmctld") and shutil.which("munged")):
        reason = "slurm-wlm and munge are not installed: apt-get install -y slurm-wlm munge (as root)"
    if reason is None:
        running = _run("status").returncode == 0
        started = _run("start")
        if started.returncode != 0:
            reason = f"compat_tests/slurm_cluster.sh start failed: {(started.stderr or started.stdout).strip()[-800:]}"
        elif not running:
            config.add_cleanup(lambda: _run("stop"))
    if reason is not None:
        _state["skip"] = f"SLURM tests skipped: {reason}"
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(_state["skip"], yellow=True)
        pytest.skip(_state["skip"])
    conf = _run("env").stdout.strip().partition("=")[2]
    _state["conf"] = conf
    return conf
