"""Machines for the fake pynvml (tests/fakes/pynvml.py): NVML names as real drivers report them."""

from __future__ import annotations

import json
import pathlib
from typing import Any

FAKES_DIR = str(pathlib.Path(__file__).resolve().parent)

# (NVML name, compute capability, memory in MiB) as NVML reports them.
RTX_PRO_6000_SERVER = ("NVIDIA RTX PRO 6000 Blackwell Server Edition", (12, 0), 97887)
RTX_PRO_6000_WS = ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", (12, 0), 97887)
RTX_PRO_6000_MAXQ = ("NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition", (12, 0), 97887)
RTX_5090 = ("NVIDIA GeForce RTX 5090", (12, 0), 32607)
RTX_4090 = ("NVIDIA GeForce RTX 4090", (8, 9), 24564)
RTX_6000_ADA = ("NVIDIA RTX 6000 Ada Generation", (8, 9), 49140)
L40S = ("NVIDIA L40S", (8, 9), 46068)
A6000 = ("NVIDIA RTX A6000", (8, 6), 49140)
B200 = ("NVIDIA B200", (10, 0), 183359)
H100 = ("NVIDIA H100 80GB HBM3", (9, 0), 81559)
A100_80 = ("NVIDIA A100-SXM4-80GB", (8, 0), 81920)


def card(spec: tuple[str, tuple[int, int] | None, int], i: int, *, pids: tuple[int, ...] = ()) -> dict[str, Any]:
    """One fake device; UUIDs and PCI ids are distinct per position `i`. A capability of None: NVML cannot read it."""
    name, cc, mem = spec
    return {
        "name": name,
        "cc": list(cc) if cc is not None else None,
        "memory_mib": mem,
        "uuid": f"GPU-{i:x}{i:x}a1b2c3-d4e5-f607-1829-3a4b5c6d7e{i:02x}",
        "pci": f"00000000:{0x18 + 0x10 * i:02X}:00.0",
        "pids": list(pids),
    }


def machine(
    *specs: tuple[str, tuple[int, int] | None, int],
    driver: str = "580.95.05",
    cuda: int = 13000,
    p2p: int = 0,
    nvlink: list[tuple[int, int]] | None = None,
    pids: dict[int, tuple[int, ...]] | None = None,
    bytes_names: bool = False,
) -> str:
    """FAKE_PYNVML for a machine with these cards, in NVML (PCI) order."""
    pids = pids or {}
    devices = [card(s, i, pids=pids.get(i, ())) for i, s in enumerate(specs)]
    return json.dumps(
        {
            "driver": driver,
            "cuda": cuda,
            "devices": devices,
            "p2p": p2p,
            "nvlink": [list(p) for p in (nvlink or [])],
            "bytes_names": bytes_names,
        }
    )


def uuid_of(i: int) -> str:
    """The UUID `card(..., i)` gives the card at NVML index i."""
    return f"GPU-{i:x}{i:x}a1b2c3-d4e5-f607-1829-3a4b5c6d7e{i:02x}"
