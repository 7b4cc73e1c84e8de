"""The NCCL version reader, against a fake libnccl.so.2 compiled here (gcc) and a fake wheel layout.

On a machine with a real NCCL wheel installed, the fake wheel takes that wheel's name and comes first
on sys.path, so it shadows it; only the cases that need no NCCL wheel at all are skipped there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from levers9.distributed.hardware import nccl
from tests.fakes import build_fake_nccl, build_fake_nccl_wheel

pytestmark = pytest.mark.procs

REPORT = (
    "import json; from levers9.distributed.hardware import nccl; i = nccl.nccl_info(); "
    "print(json.dumps({'version': i.version, 'path': i.path, 'source': i.source, 'wheel': i.wheel, "
    "'wheel_version': i.wheel_version, 'build_cuda': i.build_cuda, 'wheel_is_loaded': i.wheel_is_loaded, "
    "'text': i.version_text}))"
)


def _report(env_extra: dict[str, str], prelude: str = "") -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "PYTHONPATH")}
    env.update(env_extra)
    out = subprocess.run(
        [sys.executable, "-c", prelude + REPORT], env=env, capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


REAL_WHEEL, REAL_WHEEL_LIB = nccl._wheel()[0], nccl._wheel_library()
FAKE_WHEEL = REAL_WHEEL or "nvidia-nccl-cu12"  # same name as a real wheel here, so the fake one shadows it
needs_no_nccl_wheel = pytest.mark.skipif(
    bool(REAL_WHEEL or REAL_WHEEL_LIB),
    reason=f"a real NCCL wheel ({REAL_WHEEL or REAL_WHEEL_LIB}) is installed: the lookup finds it before a "
    "system library, and there is no machine without NCCL to test here",
)


_fake_wheel = build_fake_nccl_wheel


@needs_no_nccl_wheel
def test_system_library_by_soname(tmp_path: Path) -> None:
    build_fake_nccl(tmp_path / "sys", 22602, "2.26.2+cuda12.2")
    r = _report({"LD_LIBRARY_PATH": str(tmp_path / "sys")})
    assert r["version"] == [2, 26, 2]
    assert r["source"] == "system" and r["path"] == str(tmp_path / "sys" / "libnccl.so.2")
    assert r["build_cuda"] == [12, 2] and r["text"] == "2.26.2+cuda12.2"
    assert r["wheel"] is None and not r["wheel_is_loaded"]


def test_wheel_library_wins_over_the_system_one(tmp_path: Path) -> None:
    build_fake_nccl(tmp_path / "sys", 22105, "2.21.5+cuda12.4")
    lib = _fake_wheel(tmp_path / "site", "2.26.2.post1", 22602, "2.26.2+cuda12.8")
    r = _report({"LD_LIBRARY_PATH": str(tmp_path / "sys"), "PYTHONPATH": str(tmp_path / "site")})
    assert r["source"] == "wheel" and r["path"] == str(lib)
    assert r["version"] == [2, 26, 2] and r["build_cuda"] == [12, 8]
    assert r["wheel"] == FAKE_WHEEL and r["wheel_version"] == "2.26.2.post1" and r["wheel_is_loaded"]


def test_the_library_already_loaded_wins(tmp_path: Path) -> None:
    """What torch loaded (here: loaded by hand first) is what runs, whatever else is installed."""
    loaded = build_fake_nccl(tmp_path / "loaded", 22705, "2.27.5+cuda12.9")
    _fake_wheel(tmp_path / "site", "2.26.2", 22602, "2.26.2+cuda12.2")
    prelude = f"import ctypes; ctypes.CDLL({str(loaded)!r}); "
    r = _report({"PYTHONPATH": str(tmp_path / "site")}, prelude)
    assert r["source"] == "loaded" and r["path"] == str(loaded)
    assert r["version"] == [2, 27, 5] and r["build_cuda"] == [12, 9]
    assert r["wheel_version"] == "2.26.2" and not r["wheel_is_loaded"]


@needs_no_nccl_wheel
def test_no_nccl_anywhere() -> None:
    r = _report({})
    assert r["version"] is None and r["path"] is None and r["text"] == "unknown"


def test_a_build_without_a_readable_string(tmp_path: Path) -> None:
    lib = build_fake_nccl(tmp_path, 22803, None)
    assert nccl.build_string(str(lib)) is None
    assert nccl.build_string(str(tmp_path / "missing.so")) is None
    with_string = build_fake_nccl(tmp_path / "b", 22803, "2.28.3+cuda13.0")
    assert nccl.build_string(str(with_string)) == ("2.28.3", 13, 0)


@pytest.mark.fast
@pytest.mark.parametrize(("code", "expected"), [(22703, (2, 27, 3)), (20901, (2, 9, 1)), (2708, (2, 7, 8))])
def test_decode_version_both_encodings(code: int, expected: tuple[int, int, int]) -> None:
    assert nccl.decode_version(code) == expected
