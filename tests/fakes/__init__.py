"""Fake hardware for tests: a fake pynvml module (this folder goes first on sys.path) and a fake libnccl."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.fakes.machines import FAKES_DIR

FAKE_NCCL_C = Path(FAKES_DIR) / "fake_nccl.c"


def use_fake_pynvml(monkeypatch: pytest.MonkeyPatch, machine_json: str | None) -> None:
    """Make `import pynvml` give the fake, describing `machine_json` (None: NVML library not found)."""
    from levers9.distributed.hardware import cards

    monkeypatch.syspath_prepend(FAKES_DIR)
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    if machine_json is None:
        monkeypatch.delenv("FAKE_PYNVML", raising=False)
    else:
        monkeypatch.setenv("FAKE_PYNVML", machine_json)
    import pynvml

    assert str(Path(pynvml.__file__).parent) == FAKES_DIR
    cards.clear_cache()


def build_fake_nccl(folder: Path, code: int, version_string: str | None) -> Path:
    """Compile fake_nccl.c into folder/libnccl.so.2 reporting ncclGetVersion == code."""
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "libnccl.so.2"
    args = ["gcc", "-shared", "-fPIC", "-O1", f"-DFAKE_CODE={code}", "-o", str(out), str(FAKE_NCCL_C)]
    if version_string is not None:
        args.insert(-3, f'-DFAKE_VERSION_STRING="NCCL version {version_string}"')
    subprocess.run(args, check=True, capture_output=True, text=True)
    return out


def installed_nccl_wheel() -> str | None:
    """The name of a real NCCL wheel installed here (CUDA builds of torch bring one), else None."""
    from levers9.distributed.hardware import nccl

    return nccl._wheel()[0]


def build_fake_nccl_wheel(site: Path, version: str, code: int, build: str) -> Path:
    """site/nvidia/nccl/lib/libnccl.so.2 plus the dist-info importlib.metadata reads, under the name of the
    real wheel installed here (if any): with `site` first on PYTHONPATH it shadows that wheel, as a newer
    wheel a user installed would. Where the lookup reads first, so it holds on CPU and CUDA builds alike."""
    name = installed_nccl_wheel() or "nvidia-nccl-cu12"
    lib = build_fake_nccl(site / "nvidia" / "nccl" / "lib", code, build)
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return lib
