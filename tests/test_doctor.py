"""`levers9 doctor` end to end: `python -m levers9 doctor` in a subprocess, with a fake NVML or none."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fakes import build_fake_nccl_wheel
from tests.fakes.machines import FAKES_DIR, H100, RTX_PRO_6000_SERVER, machine, uuid_of

pytestmark = pytest.mark.procs


def doctor(
    *args: str, env_extra: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "PYTHONPATH", "FAKE_PYNVML")}
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "levers9", "doctor", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def with_fake(machine_json: str, **more: str) -> dict[str, str]:
    return {"PYTHONPATH": FAKES_DIR, "FAKE_PYNVML": machine_json, **more}


def test_no_nvml_at_all_says_no_cards_and_exits_0() -> None:
    r = doctor(
        env_extra={"PYTHONPATH": FAKES_DIR}
    )  # the fake with no machine: "NVML Shared Library Not Found"
    assert r.returncode == 0, r.stderr
    assert "No NVIDIA cards visible to this process" in r.stdout
    assert "finite-init-timeout" in r.stdout


def test_no_nvml_json() -> None:
    r = doctor("--json", env_extra={"PYTHONPATH": FAKES_DIR})
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["cards"]["cards"] == [] and "NVML" in report["cards"]["error"]
    assert report["quirks"]["backend"] == "gloo" and report["quirks"]["errors"] == []
    assert report["launch"]["launcher"] == "single" and report["launch"]["world_size"] == 1
    assert report["torch"]["cuda_initialised"] is False


def test_probe_with_no_cards_has_nothing_to_probe() -> None:
    r = doctor("--probe", env_extra={"PYTHONPATH": FAKES_DIR})
    assert r.returncode == 0, r.stderr
    assert "nothing to probe" in r.stdout


def _torch_loads_nccl() -> bool:
    """True on a CUDA build of torch: `import torch` maps its own NCCL wheel, which is then the NCCL that runs."""
    probe = "import torch; print(sum('libnccl' in line for line in open('/proc/self/maps')))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120).stdout.strip()
    return out not in ("", "0")


# The doctor imports torch, and a CUDA build's `import torch` loads its own NCCL: no planted library can then be
# the one that runs, which is what the doctor reports (tests/test_quirks.py covers the check on CUDA builds too).
@pytest.mark.skipif(_torch_loads_nccl(), reason="torch is a CUDA build: its own NCCL is loaded at import")
def test_four_rtx_pro_6000_with_old_nccl(tmp_path: Path) -> None:
    build_fake_nccl_wheel(tmp_path / "site", "2.26.2", 22602, "2.26.2+cuda12.2")
    env = with_fake(machine(*[RTX_PRO_6000_SERVER] * 4, pids={1: (777,)}))
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), env["PYTHONPATH"]])
    text = doctor(env_extra=env)
    assert text.returncode == 1  # a quirk would refuse to run
    assert "NVIDIA RTX PRO 6000 Blackwell Server Edition [RTXPro6000] cc 12.0, 97887 MiB" in text.stdout
    assert "processes 777" in text.stdout and "OK/-" in text.stdout
    assert "NCCL 2.26.2+cuda12.2" in text.stdout
    assert "* rtxpro6000-p2p (set-env): applies" in text.stdout and "sets NCCL_P2P_DISABLE=1" in text.stdout
    assert "ERROR [blackwell-nccl-kernels]" in text.stdout and "nvidia-nccl-cu12>=2.26.5" in text.stdout

    report = json.loads(doctor("--json", env_extra=env).stdout)
    assert [c["type_name"] for c in report["cards"]["cards"]] == ["RTXPro6000"] * 4
    assert report["nccl"]["version"] == [2, 26, 2] and report["nccl"]["build_cuda"] == [12, 2]
    assert report["quirks"]["local_world_size"] == 4 and report["quirks"]["set_env"] == {
        "NCCL_P2P_DISABLE": "1"
    }
    rows = {row["id"]: row for row in report["quirks"]["rows"]}
    assert rows["blackwell-nccl-kernels"]["status"] == "applies"
    assert rows["shm-too-small"]["status"] == "does not apply"


def test_visible_devices_user_settings_and_opt_out_show_up(tmp_path: Path) -> None:
    env = with_fake(
        machine(H100, RTX_PRO_6000_SERVER, RTX_PRO_6000_SERVER),
        CUDA_VISIBLE_DEVICES=f"{uuid_of(2)},1",  # a UUID, then PCI index 1
        CUDA_DEVICE_ORDER="PCI_BUS_ID",
        NCCL_P2P_DISABLE="0",
        LEVERS9_DISABLE_QUIRKS="blackwell-nccl-kernels",
    )
    r = doctor("--json", env_extra=env)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert [c["nvml_index"] for c in report["cards"]["cards"]] == [2, 1]
    rows = {row["id"]: row for row in report["quirks"]["rows"]}
    assert rows["rtxpro6000-p2p"]["kept"] == {"NCCL_P2P_DISABLE": "0"} and report["quirks"]["set_env"] == {}
    assert rows["blackwell-nccl-kernels"]["status"] == "disabled"
    assert report["env"]["NCCL_P2P_DISABLE"] == "0"


def test_probe_retries_with_fixes_and_reports_each_attempt(tmp_path: Path) -> None:
    """Fake cards but no CUDA here: every attempt fails for real, in a child; doctor tries each fix and says so."""
    env = with_fake(machine(H100, H100), LD_LIBRARY_PATH=str(tmp_path))
    r = doctor("--probe", "--probe-timeout", "60", env_extra=env, timeout=300)
    assert r.returncode == 1
    assert "as levers9 runs it: failed" in r.stdout
    assert "NCCL_P2P_DISABLE=1: failed" in r.stdout
    assert "failed with every setting tried" in r.stdout


def _probe_children() -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "_probe_child(" in line and "ps -eo" not in line]


def test_a_hung_probe_is_killed_with_everything_it_started() -> None:
    env = with_fake(machine(H100, H100))
    r = doctor("--probe", "--probe-timeout", "0.3", env_extra=env, timeout=120)
    assert r.returncode == 1
    assert "as levers9 runs it: hung (no result after 0.3 s)" in r.stdout
    assert "NCCL_CUMEM_HOST_ENABLE=0: hung" in r.stdout
    assert _probe_children() == []


def test_real_pynvml_without_a_driver_says_no_cards() -> None:
    """This CPU box as it is: the installed nvidia-ml-py finds no NVML library; doctor says so and exits 0."""
    from levers9.distributed.hardware.cards import _DRIVER_MARKERS

    if any(os.path.exists(p) for p in _DRIVER_MARKERS):
        pytest.skip("this machine has an NVIDIA driver")
    r = doctor()
    assert r.returncode == 0, r.stderr
    assert "No NVIDIA cards visible to this process" in r.stdout
