"""A fake `pynvml` (nvidia-ml-py) for tests: put this folder first on sys.path.

The machine it describes comes from the environment variable FAKE_PYNVML (JSON, see machines.py),
read at nvmlInit(), so a subprocess given PYTHONPATH and FAKE_PYNVML sees the same cards. Only the
calls levers9 makes exist; they behave like nvidia-ml-py 13.x, including its quirks (str names,
NVML_P2P_CAPS_INDEX_READ being the tuple (0,), errors as NVMLError subclasses).
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

NVML_P2P_CAPS_INDEX_READ = (0,)  # the real module has a trailing comma here
NVML_P2P_CAPS_INDEX_WRITE = 1
NVML_P2P_CAPS_INDEX_NVLINK = 2
NVML_P2P_STATUS_OK = 0
NVML_P2P_STATUS_NOT_SUPPORTED = 5
NVML_NVLINK_MAX_LINKS = 36

INIT_CALLS = 0  # how many times nvmlInit ran in this process (tests read it to prove caching)


class NVMLError(Exception):
    def __init__(self, value: int, text: str) -> None:
        super().__init__(text)
        self.value = value


class NVMLError_Uninitialized(NVMLError):  # noqa: N801 (the real names)
    def __init__(self) -> None:
        super().__init__(1, "Uninitialized")


class NVMLError_NotSupported(NVMLError):  # noqa: N801
    def __init__(self) -> None:
        super().__init__(3, "Not Supported")


class NVMLError_DriverNotLoaded(NVMLError):  # noqa: N801
    def __init__(self) -> None:
        super().__init__(9, "Driver Not Loaded")


class NVMLError_LibraryNotFound(NVMLError):  # noqa: N801
    def __init__(self) -> None:
        super().__init__(12, "NVML Shared Library Not Found")


_ERRORS = {"DriverNotLoaded": NVMLError_DriverNotLoaded, "LibraryNotFound": NVMLError_LibraryNotFound}
_machine: dict[str, Any] | None = None


def _m() -> dict[str, Any]:
    if _machine is None:
        raise NVMLError_Uninitialized()
    return _machine


def nvmlInit() -> None:
    global _machine, INIT_CALLS
    INIT_CALLS += 1
    config = json.loads(os.environ.get("FAKE_PYNVML", '{"error": "LibraryNotFound"}'))
    if config.get("error"):
        raise _ERRORS[config["error"]]()
    _machine = config


def nvmlShutdown() -> None:
    global _machine
    _m()
    _machine = None


def nvmlSystemGetDriverVersion() -> str:
    return str(_m().get("driver", "580.95.05"))


def nvmlSystemGetCudaDriverVersion() -> int:
    return int(_m().get("cuda", 13000))


def nvmlDeviceGetCount() -> int:
    return len(_m()["devices"])


def nvmlDeviceGetHandleByIndex(index: int) -> SimpleNamespace:
    devices = _m()["devices"]
    if not isinstance(index, int) or not 0 <= index < len(devices):
        raise NVMLError(2, "Invalid Argument")
    return SimpleNamespace(index=index)


def _dev(handle: SimpleNamespace) -> dict[str, Any]:
    dev: dict[str, Any] = _m()["devices"][handle.index]
    return dev


def nvmlDeviceGetName(handle: SimpleNamespace) -> str | bytes:
    name = _dev(handle)["name"]
    return name.encode() if _m().get("bytes_names") else name  # nvidia-ml-py <= 11.495 returned bytes


def nvmlDeviceGetUUID(handle: SimpleNamespace) -> str:
    return str(_dev(handle)["uuid"])


def nvmlDeviceGetPciInfo(handle: SimpleNamespace) -> SimpleNamespace:
    return SimpleNamespace(busId=_dev(handle)["pci"].encode())  # a c_char array reads as bytes


def nvmlDeviceGetCudaComputeCapability(handle: SimpleNamespace) -> tuple[int, int]:
    if _dev(handle)["cc"] is None:  # a device or driver that cannot answer
        raise NVMLError_NotSupported()
    major, minor = _dev(handle)["cc"]
    return int(major), int(minor)


def nvmlDeviceGetMemoryInfo(handle: SimpleNamespace) -> SimpleNamespace:
    total = int(_dev(handle)["memory_mib"]) * 1024 * 1024
    return SimpleNamespace(total=total, free=total, used=0)


def nvmlDeviceGetComputeRunningProcesses(handle: SimpleNamespace) -> list[SimpleNamespace]:
    return [SimpleNamespace(pid=pid, usedGpuMemory=None) for pid in _dev(handle).get("pids", [])]


def nvmlDeviceGetP2PStatus(h1: SimpleNamespace, h2: SimpleNamespace, index: int) -> int:
    if not isinstance(index, int):  # what ctypes does with the (0,) tuple
        raise TypeError("argument 3: TypeError: Don't know how to convert parameter 3")
    if index == NVML_P2P_CAPS_INDEX_NVLINK:
        pairs = [sorted(p) for p in _m().get("nvlink", [])]
        return NVML_P2P_STATUS_OK if sorted([h1.index, h2.index]) in pairs else NVML_P2P_STATUS_NOT_SUPPORTED
    return int(_m().get("p2p", NVML_P2P_STATUS_NOT_SUPPORTED))


def nvmlDeviceGetNvLinkState(handle: SimpleNamespace, link: int) -> int:
    raise NVMLError_NotSupported()
