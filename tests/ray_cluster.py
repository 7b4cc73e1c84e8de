"""One local Ray per test session: 2 CPUs, 4 logical GPUs declared as levers9_RTXPro6000.

Started on first use (about 5-14 s here), shut down when pytest ends, and everything it wrote (Ray's
session folder, the jobs' scratch folders) lives under one temp folder that is removed then. Test
modules call `address(request.config)`; a module-level singleton (not a fixture imported into two
modules, which pytest would set up twice) keeps it to one Ray.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile

import pytest

CARDS = 4
TYPE = "RTXPro6000"
_state: dict[str, str] = {}
# Ray runs its workers, and so the ranks a job forks there, at nice 15 by default. Beside the other pytest
# workers' tests (at nice 0) on 2 cores they then get a small share of the CPU: a 100 MB line through a
# two-node job made its test take 158 s instead of 28 with three busy loops beside it, and CI's 220 s limit failed once.
# The test clusters run their workers at nice 0, as a dedicated node's only work would.
WORKERS_AT_NICE_0 = {"worker_niceness": 0}

# Token auth with the token in the environment (drivers that tests start inherit it), so Ray writes
# no ~/.ray/auth_token. Set when this module is imported, at collection: Ray reads them once, when
# it is first imported, which may be before the cluster starts.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))


def address(config: pytest.Config) -> str:
    """The GCS address of the session's Ray, started now if this is the first call."""
    if "address" in _state:
        return _state["address"]
    import ray  # the test extra installs it: a missing Ray is an error, never a skip
    root = tempfile.mkdtemp(prefix="l9ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    saved = {k: v for k, v in os.environ.items() if k.startswith("LEVERS9_") or k == "TMPDIR"}
    try:
        # Ray's processes inherit this environment: no test's LEVERS9_* settings, and scratch under root.
        for key in saved:
            del os.environ[key]
        os.environ["TMPDIR"] = root
        for tries_left in (1, 0):
            try:
                ray.init(
                    num_cpus=2,
                    num_gpus=CARDS,
                    resources={f"levers9_{TYPE}": CARDS},
                    include_dashboard=False,
                    log_to_driver=False,
                    object_store_memory=200 * 2**20,
                    _temp_dir=os.path.join(root, "r"),
                    _system_config=dict(WORKERS_AT_NICE_0),  # a copy: ray.init adds its own keys to the dict given
                )
                break
            except Exception as exc:
                # Ray waits a fixed 30 s for its raylet to register (ray/_private/node.py), which a 2-core machine
                # busy with two other pytest workers once exceeded in CI: start the cluster once more, never a test
                if tries_left == 0 or "timed out during startup" not in str(exc):
                    raise
                ray.shutdown()
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    finally:
        os.environ.pop("TMPDIR", None)
        os.environ.update(saved)  # what ray.init itself set (RAY_AUTH_MODE, ...) stays, as in any driver
    _state["address"] = ray.get_runtime_context().gcs_address
    _state["root"] = root
    config.add_cleanup(_shutdown)
    return _state["address"]


def release() -> None:
    """Shut the session's Ray down now if it runs (a module that needs a cluster of its own calls this);
    the next `address` call starts it again."""
    if "address" in _state:
        _shutdown()


def _shutdown() -> None:
    import ray

    if "root" not in _state:
        return
    ray.shutdown()
    shutil.rmtree(_state.pop("root"), ignore_errors=True)
    _state.pop("address", None)
