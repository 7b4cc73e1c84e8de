"""The session's SLURM: the real two-node cluster of compat_tests/slurm_cluster.sh (2 nodes x 2 GRES cards).

Started on first use (when it is not running already, as in CI, which starts it before pytest) and
stopped when the pytest run that started it ends. Several pytest-xdist workers may ask at once: the
script's lock makes them take turns, the first start is recorded with the run's id in the cluster's folder
(OWNER), and only the run's controller stops it, once every worker is done (`stop_if_started_here`): a
worker that ended early never stops the cluster under another's tests. Where it cannot run (not root,
slurm-wlm or munge not installed, a daemon that does not come up), the `slurm` tests are skipped with the
reason printed on the terminal, never silently. A module-level singleton, as tests/ray_cluster.py, keeps
it to one start per process.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "compat_tests" / "slurm_cluster.sh"
OWNER = "pytest-run"  # in the cluster's folder: the id of the pytest run that started the cluster
_state: dict[str, str] = {}


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=180)


def run_id(config: pytest.Config) -> str:
    """The id every process of this pytest run shares: pytest-xdist's testrunuid, which the controller chooses
    here, before it starts its workers, when --testrunuid did not."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        return str(workerinput["testrunuid"])
    if not getattr(config.option, "testrunuid", None):
        config.option.testrunuid = uuid.uuid4().hex
    return str(config.option.testrunuid)


def _conf() -> Path:
    """The cluster's slurm.conf (the script's `env`), in the cluster's folder."""
    return Path(_run("env").stdout.strip().partition("=")[2])


def stop_if_started_here(config: pytest.Config) -> None:
    """Stop the cluster if a process of this pytest run started it (called once, by the run's controller)."""
    if os.geteuid() != 0 or not shutil.which("slurmctld"):  # no cluster can have been started
        return
    owner = _conf().with_name(OWNER)
    if owner.is_file() and owner.read_text() == run_id(config):
        _run("stop")
        owner.unlink()


def slurm_conf(config: pytest.Config) -> str:
    """SLURM_CONF of the running cluster, started now if needed; pytest.skip with a printed reason if it cannot be."""
    if "skip" in _state:
        pytest.skip(_state["skip"])
    if "conf" in _state:
        return _state["conf"]
    reason = None
    if os.geteuid() != 0:
        reason = f"the SLURM tests need root to start the cluster daemons (uid {os.geteuid()}): run pytest as root"
    elif not all(shutil.which(tool) for tool in ("slurmctld", "munged", "slurmdbd", "mariadbd")):
        reason = ("slurm-wlm, munge, slurmdbd or mariadb-server is not installed: apt-get install -y slurm-wlm munge "
                  "slurmdbd mariadb-server (as root)")
    if reason is None:
        started = _run("start")  # under the script's lock: of workers asking at once, one starts it
        if started.returncode != 0:
            reason = f"compat_tests/slurm_cluster.sh start failed: {(started.stderr or started.stdout).strip()[-800:]}"
        else:
            conf = _state["conf"] = str(_conf())
            if "already running" not in started.stdout:  # this process started it: the run owns it
                Path(conf).with_name(OWNER).write_text(run_id(config))
    if reason is not None:
        _state["skip"] = f"SLURM tests skipped: {reason}"
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(_state["skip"], yellow=True)
        pytest.skip(_state["skip"])
    return _state["conf"]
