"""The NVIDIA cards this process may use, read through NVML without touching CUDA.

NVML (`pynvml`, from the `nvidia-ml-py` package) numbers cards in PCI order and ignores
`CUDA_VISIBLE_DEVICES`; CUDA numbers them in `CUDA_DEVICE_ORDER` (fastest first unless set to
`PCI_BUS_ID`) and then keeps only the visible ones. `visible_cards()` maps one onto the other, so
`Card.index` is the CUDA index torch will use in this process and `Card.nvml_index` is the machine's.

Reading never initialises CUDA (a later fork stays safe) and never raises for missing hardware: no
driver, no NVML, no cards all give an empty list. One NVML read per process is cached; pass
`refresh=True` (or call `clear_cache()`) for fresh numbers such as the processes on each card.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from levers9.distributed.hardware.gpu_types import type_of_card

log = logging.getLogger("levers9.cards")

# Signs of an NVIDIA driver, checked before importing pynvml (which alone costs ~15 ms): the kernel
# module's proc entry and control device (also present inside containers given the GPUs), and
# WSL2's GPU paravirtualisation device. If pynvml is already imported, it is asked directly.
_DRIVER_MARKERS = ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/dxg")

# nvmlDeviceGetP2PStatus answers, as `nvidia-smi topo -p2p` abbreviates them.
P2P_STATUS_NAMES = {0: "OK", 1: "CNS", 2: "GNS", 3: "TNS", 4: "NS", 5: "NS", 6: "U"}
_P2P_READ = 0  # pynvml.NVML_P2P_CAPS_INDEX_READ is the tuple (0,) (a trailing comma), so pass 0
_P2P_NVLINK = 2


@dataclasses.dataclass(frozen=True)
class Card:
    """One NVIDIA card as this process sees it."""

    index: int  # CUDA index in this process (position in CUDA_VISIBLE_DEVICES order)
    nvml_index: int  # NVML / PCI-order index on the machine
    uuid: str
    name: str  # NVML's full name, e.g. "NVIDIA RTX PRO 6000 Blackwell Server Edition"
    type_name: str  # gpu_types.type_of_card(name, memory_mib), e.g. "RTXPro6000"
    pci_bus_id: str
    compute_capability: tuple[int, int] | None  # None when NVML cannot read it
    memory_total_mib: int
    processes: tuple[int, ...]  # pids of compute processes on the card

    def describe(self) -> str:
        """'card 0 (NVIDIA RTX PRO 6000 Blackwell Server Edition, compute capability 12.0)'."""
        cc = self.compute_capability
        return f"card {self.index} ({self.name}, compute capability {'unknown' if cc is None else f'{cc[0]}.{cc[1]}'})"


@dataclasses.dataclass(frozen=True)
class Inventory:
    """The visible cards plus what lies between them and under them (driver, CUDA driver API)."""

    cards: tuple[Card, ...] = ()
    driver_version: str | None = None  # e.g. "580.95.05"
    cuda_driver_version: str | None = None  # the CUDA version the driver supports, e.g. "12.8"
    # Keyed by pairs of CUDA indices (i, j), i != j, of visible cards.
    p2p: Mapping[tuple[int, int], str] = dataclasses.field(default_factory=dict)  # "OK", "CNS", "NS", ...
    nvlink: Mapping[tuple[int, int], bool] = dataclasses.field(default_factory=dict)
    error: str | None = None  # why no cards could be read (no driver, no pynvml, an NVML error)

    def has_nvlink(self, cards: tuple[Card, ...] | list[Card] | None = None) -> bool:
        """True if any pair among `cards` (default: all visible) is joined by NVLink."""
        return any(self._pairs(self.nvlink, cards))

    def p2p_reported(self, cards: tuple[Card, ...] | list[Card] | None = None) -> bool:
        """True if the driver reports P2P reads as OK for any pair among `cards` (default: all visible)."""
        return "OK" in self._pairs(self.p2p, cards)

    def _pairs(self, matrix: Mapping[tuple[int, int], Any], cards: Sequence[Card] | None) -> list[Any]:
        idx = {c.index for c in (self.cards if cards is None else cards)}
        return [v for (i, j), v in matrix.items() if i in idx and j in idx]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready view (pairs as "i,j" keys)."""
        return {
            "cards": [dataclasses.asdict(c) for c in self.cards],
            "driver_version": self.driver_version,
            "cuda_driver_version": self.cuda_driver_version,
            "p2p": {f"{i},{j}": v for (i, j), v in sorted(self.p2p.items())},
            "nvlink": {f"{i},{j}": v for (i, j), v in sorted(self.nvlink.items())},
            "error": self.error,
        }


_lock = threading.Lock()
# Process-wide, as NVML's own initialisation is: every card on the machine, read once, in NVML order (as
# an Inventory whose card indices and pairs are NVML indices).
_machine: Inventory | None = None


def clear_cache() -> None:
    """Forget the cached NVML read; the next call reads the cards again."""
    global _machine
    with _lock:
        _machine = None


def visible_cards(env: Mapping[str, str] | None = None, *, refresh: bool = False) -> list[Card]:
    """The cards this process may use, in CUDA order; [] when there is no driver, no NVML or no card."""
    return list(inventory(env, refresh=refresh).cards)


def inventory(env: Mapping[str, str] | None = None, *, refresh: bool = False) -> Inventory:
    """Visible cards plus driver versions and the P2P / NVLink matrix between them (never raises)."""
    env = os.environ if env is None else env
    machine = _read_machine(refresh)
    chosen, note = _select(machine.cards, env)
    cards = tuple(dataclasses.replace(c, index=i) for i, c in enumerate(chosen))
    by_nvml = {c.nvml_index: c.index for c in cards}

    def by_cuda(matrix: Mapping[tuple[int, int], Any]) -> dict[tuple[int, int], Any]:
        return {(by_nvml[a], by_nvml[b]): v for (a, b), v in matrix.items() if a in by_nvml and b in by_nvml}

    error = machine.error or (note if not cards else None)
    p2p, nvlink = by_cuda(machine.p2p), by_cuda(machine.nvlink)
    return Inventory(cards, machine.driver_version, machine.cuda_driver_version, p2p, nvlink, error)


def _select(all_cards: tuple[Card, ...], env: Mapping[str, str]) -> tuple[list[Card], str | None]:
    """Apply CUDA_DEVICE_ORDER and CUDA_VISIBLE_DEVICES the way the CUDA runtime does."""
    ordered = list(all_cards)
    if env.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST").strip().upper() != "PCI_BUS_ID":
        # CUDA's FASTEST_FIRST has no published formula; on a machine of one card type it is PCI
        # order. For mixed machines, newer architectures first is the closest public approximation.
        # A card whose capability cannot be read keeps its place after the readable ones.
        ordered.sort(key=lambda c: tuple(-x for x in c.compute_capability or (-1, -1)))
    spec = env.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return ordered, None
    chosen: list[Card] = []
    for raw in spec.split(","):
        token = raw.strip()
        card = _match_token(token, ordered)
        if card is None or card in chosen:
            # CUDA stops at the first entry it cannot use and ignores the rest.
            if token:
                log.debug(
                    "CUDA_VISIBLE_DEVICES=%r: entry %r matches no unused card; ignoring it and the rest",
                    spec,
                    token,
                )
            break
        chosen.append(card)
    note = None if chosen or not ordered else f"CUDA_VISIBLE_DEVICES={spec!r} hides every card"
    return chosen, note


def _match_token(token: str, ordered: list[Card]) -> Card | None:
    """The card an entry of CUDA_VISIBLE_DEVICES names: an index, or a (unique prefix of a) GPU-UUID."""
    if token.lstrip("+-").isdigit():
        i = int(token)
        return ordered[i] if 0 <= i < len(ordered) else None
    if token.upper().startswith("GPU-"):
        want = token[4:].lower()
        hits = [c for c in ordered if c.uuid.lower().removeprefix("gpu-").startswith(want)]
        return hits[0] if len(hits) == 1 else None
    return None  # MIG-... instances and anything else: not a whole card


def _read_machine(refresh: bool) -> Inventory:
    global _machine
    with _lock:
        if _machine is None or refresh:
            _machine = _read_nvml()
        return _machine


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _read_nvml() -> Inventory:
    """Everything NVML says about the machine's cards, or an empty machine with the reason."""
    if "pynvml" not in sys.modules and not any(os.path.exists(p) for p in _DRIVER_MARKERS):
        markers = ", ".join(_DRIVER_MARKERS)
        return Inventory(error=f"no NVIDIA driver on this machine (none of {markers} exists)")
    try:
        import pynvml
    except Exception as exc:  # ImportError, or a broken install
        fix = "install it with: pip install nvidia-ml-py"
        return Inventory(error=f"pynvml cannot be imported ({exc}); {fix}")
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # pynvml.NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        return Inventory(error=f"NVML is not available: {exc}")
    try:
        return _read_initialised(pynvml)
    except Exception as exc:
        return Inventory(error=f"NVML failed while reading the cards: {exc}")
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _read_initialised(nv: Any) -> Inventory:
    driver = _optional(lambda: _text(nv.nvmlSystemGetDriverVersion()))
    code = _optional(nv.nvmlSystemGetCudaDriverVersion)  # 12080 for CUDA 12.8
    cuda = f"{code // 1000}.{code % 1000 // 10}" if isinstance(code, int) and code > 0 else None
    count = int(nv.nvmlDeviceGetCount())
    handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    cards = []
    for i, h in enumerate(handles):
        name = _text(nv.nvmlDeviceGetName(h))
        memory_mib = int(nv.nvmlDeviceGetMemoryInfo(h).total) // (1024 * 1024)
        cc = _optional(lambda h=h: tuple(nv.nvmlDeviceGetCudaComputeCapability(h)))
        pci = _optional(lambda h=h: _text(nv.nvmlDeviceGetPciInfo(h).busId)) or ""
        procs = _optional(lambda h=h: tuple(int(p.pid) for p in nv.nvmlDeviceGetComputeRunningProcesses(h)))
        cards.append(
            Card(
                index=i,
                nvml_index=i,
                uuid=_text(nv.nvmlDeviceGetUUID(h)),
                name=name,
                type_name=type_of_card(name, memory_mib),
                pci_bus_id=pci,
                compute_capability=(int(cc[0]), int(cc[1])) if cc else None,
                memory_total_mib=memory_mib,
                processes=procs or (),
            )
        )
    p2p: dict[tuple[int, int], str] = {}
    nvlink: dict[tuple[int, int], bool] = {}
    for a, b in itertools.permutations(range(count), 2):
        status = _optional(lambda a=a, b=b: int(nv.nvmlDeviceGetP2PStatus(handles[a], handles[b], _P2P_READ)))
        p2p[(a, b)] = P2P_STATUS_NAMES.get(status, "U")
        link = _optional(lambda a=a, b=b: int(nv.nvmlDeviceGetP2PStatus(handles[a], handles[b], _P2P_NVLINK)))
        nvlink[(a, b)] = link == 0
    return Inventory(tuple(cards), driver, cuda, p2p, nvlink, None if cards else "NVML reports no cards")


def _optional(read: Any) -> Any:
    """read(), or None when this driver / card cannot answer (NotSupported and the like)."""
    try:
        return read()
    except Exception:
        return None
