"""The card inventory: NVML read through a fake pynvml, CUDA_VISIBLE_DEVICES and order, no-hardware cases."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from levers9.distributed.hardware import cards
from levers9.distributed.hardware.gpu_types import type_of_card
from tests.fakes import use_fake_pynvml
from tests.fakes.machines import (
    A100_80,
    B200,
    H100,
    RTX_4090,
    RTX_PRO_6000_SERVER,
    RTX_PRO_6000_WS,
    machine,
    uuid_of,
)

pytestmark = pytest.mark.fast

FOUR_PRO = machine(*[RTX_PRO_6000_SERVER] * 4, pids={2: (4242, 4343)})


def test_reads_every_field_in_nvml_order(monkeypatch: pytest.MonkeyPatch) -> None:
    use_fake_pynvml(monkeypatch, FOUR_PRO)
    inv = cards.inventory()
    assert [c.index for c in inv.cards] == [0, 1, 2, 3]
    first = inv.cards[0]
    assert first.name == "NVIDIA RTX PRO 6000 Blackwell Server Edition"
    assert first.type_name == "RTXPro6000"
    assert first.compute_capability == (12, 0)
    assert first.memory_total_mib == 97887
    assert first.uuid == uuid_of(0)
    assert first.pci_bus_id == "00000000:18:00.0"  # bytes from the c_char array, decoded
    assert inv.cards[2].processes == (4242, 4343)
    assert inv.driver_version == "580.95.05"
    assert inv.cuda_driver_version == "13.0"
    assert inv.p2p[(0, 1)] == "OK"
    assert not inv.has_nvlink()


def test_bytes_names_from_old_nvidia_ml_py_are_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    use_fake_pynvml(monkeypatch, machine(RTX_4090, bytes_names=True))
    assert cards.visible_cards()[0].name == "NVIDIA GeForce RTX 4090"


def test_visible_devices_by_index_selects_and_orders(monkeypatch: pytest.MonkeyPatch) -> None:
    use_fake_pynvml(monkeypatch, FOUR_PRO)
    chosen = cards.visible_cards({"CUDA_VISIBLE_DEVICES": "3,1"})
    assert [(c.index, c.nvml_index) for c in chosen] == [(0, 3), (1, 1)]
    assert [c.uuid for c in chosen] == [uuid_of(3), uuid_of(1)]


def test_visible_devices_by_full_and_short_uuid(monkeypatch: pytest.MonkeyPatch) -> None:
    use_fake_pynvml(monkeypatch, FOUR_PRO)
    full = cards.visible_cards({"CUDA_VISIBLE_DEVICES": f"{uuid_of(2)},{uuid_of(0)}"})
    assert [c.nvml_index for c in full] == [2, 0]
    short = cards.visible_cards({"CUDA_VISIBLE_DEVICES": "GPU-11a1,GPU-33"})  # unique prefixes
    assert [c.nvml_index for c in short] == [1, 3]


def test_visible_devices_stops_at_the_first_bad_entry_like_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    use_fake_pynvml(monkeypatch, FOUR_PRO)
    assert [c.nvml_index for c in cards.visible_cards({"CUDA_VISIBLE_DEVICES": "1,7,2"})] == [1]
    assert [c.nvml_index for c in cards.visible_cards({"CUDA_VISIBLE_DEVICES": "2,-1,0"})] == [2]
    assert [c.nvml_index for c in cards.visible_cards({"CUDA_VISIBLE_DEVICES": "0,0,1"})] == [0]
    empty = cards.inventory({"CUDA_VISIBLE_DEVICES": ""})
    assert empty.cards == () and "hides every card" in (empty.error or "")


def test_p2p_matrix_is_reindexed_to_cuda_order(monkeypatch: pytest.MonkeyPatch) -> None:
    use_fake_pynvml(monkeypatch, machine(H100, H100, H100, nvlink=[(0, 2)]))
    inv = cards.inventory({"CUDA_VISIBLE_DEVICES": "2,1,0"})
    assert inv.nvlink[(0, 2)] and inv.nvlink[(2, 0)]  # NVML 2<->0 is CUDA 0<->2
    assert not inv.nvlink[(0, 1)]
    assert inv.has_nvlink() and not inv.has_nvlink(inv.cards[:2])


def test_fastest_first_unless_pci_bus_id(monkeypatch: pytest.MonkeyPatch) -> None:
    use_fake_pynvml(monkeypatch, machine(A100_80, B200))  # PCI order: A100 first
    assert [c.type_name for c in cards.visible_cards({})] == ["B200", "A100-80"]
    pci = cards.visible_cards({"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert [(c.index, c.type_name) for c in pci] == [(0, "A100-80"), (1, "B200")]
    assert [
        c.type_name
        for c in cards.visible_cards({"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "1"})
    ] == ["B200"]


def test_one_nvml_read_per_process_until_refresh(monkeypatch: pytest.MonkeyPatch) -> None:
    use_fake_pynvml(monkeypatch, FOUR_PRO)
    import pynvml

    before = pynvml.INIT_CALLS
    cards.visible_cards()
    cards.visible_cards({"CUDA_VISIBLE_DEVICES": "1"})
    assert pynvml.INIT_CALLS == before + 1
    cards.visible_cards(refresh=True)
    assert pynvml.INIT_CALLS == before + 2


@pytest.mark.parametrize("error", ["LibraryNotFound", "DriverNotLoaded"])
def test_no_nvml_or_no_driver_is_an_empty_inventory(monkeypatch: pytest.MonkeyPatch, error: str) -> None:
    use_fake_pynvml(monkeypatch, f'{{"error": "{error}"}}')
    inv = cards.inventory()
    assert inv.cards == () and "NVML is not available" in (inv.error or "")
    assert cards.visible_cards() == []


def test_zero_cards(monkeypatch: pytest.MonkeyPatch) -> None:
    use_fake_pynvml(monkeypatch, machine())
    assert cards.visible_cards() == []
    for env in ({}, {"CUDA_VISIBLE_DEVICES": ""}, {"CUDA_VISIBLE_DEVICES": "0"}):
        inv = cards.inventory(env)
        assert inv.cards == () and inv.error == "NVML reports no cards", env  # not "CUDA_VISIBLE_DEVICES hides..."
        assert (inv.driver_version, inv.cuda_driver_version) == ("580.95.05", "13.0")


@pytest.mark.procs
def test_without_a_driver_pynvml_is_not_even_imported() -> None:
    """On this CPU box: no driver markers, so the answer is [] without the ~15 ms pynvml import."""
    if any(os.path.exists(p) for p in cards._DRIVER_MARKERS):
        pytest.skip("this machine has an NVIDIA driver")
    code = (
        "import sys; from levers9.distributed.hardware import cards; "
        "print(cards.visible_cards(), 'pynvml' in sys.modules, cards.inventory().error)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("[] False no NVIDIA driver")


def test_reading_cards_does_not_initialise_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    use_fake_pynvml(monkeypatch, FOUR_PRO)
    cards.inventory()
    torch = sys.modules.get("torch")
    assert torch is None or not torch.cuda.is_initialized()


# NVML names as the NVIDIA driver reports them (its README's "Compatible GPUs" table, and driver logs).
FACT_NAMES = [
    ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", 97887, "RTXPro6000"),
    ("NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition", 97887, "RTXPro6000"),
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition", 97887, "RTXPro6000"),
    ("NVIDIA RTX 6000D", 84000, "RTX6000D"),
    ("NVIDIA RTX PRO 5000 Blackwell", 49000, "RTXPro5000"),
    ("NVIDIA RTX PRO 5000 72GB Blackwell", 73000, "RTXPro5000"),
    ("NVIDIA RTX PRO 4500 Blackwell", 32000, "RTXPro4500"),
    ("NVIDIA RTX PRO 4000 Blackwell", 24000, "RTXPro4000"),
    ("NVIDIA GeForce RTX 5090", 32607, "RTX5090"),
    ("NVIDIA GeForce RTX 5090 D", 32607, "RTX5090"),
    ("NVIDIA B200", 183359, "B200"),
    ("NVIDIA GB200", 189471, "GB200"),
    ("NVIDIA RTX 6000 Ada Generation", 49140, "RTX6000Ada"),
    ("NVIDIA RTX 5880 Ada Generation", 49140, "RTX5880Ada"),
    ("NVIDIA RTX A6000", 49140, "A6000"),
    ("NVIDIA GeForce RTX 4090", 24564, "RTX4090"),
    ("NVIDIA L40S", 46068, "L40S"),
    ("NVIDIA H100 80GB HBM3", 81559, "H100"),
    ("NVIDIA A100-SXM4-80GB", 81920, "A100-80"),
    ("NVIDIA A100-SXM4-40GB", 40960, "A100-40"),
]


@pytest.mark.parametrize(("name", "memory", "expected"), FACT_NAMES)
def test_fact_file_names_map_to_job_layer_types(name: str, memory: int, expected: str) -> None:
    assert type_of_card(name, memory) == expected


def test_rtx_6000_lookalikes_are_not_rtx_pro_6000() -> None:
    for name in ("Quadro RTX 6000", "NVIDIA RTX 6000 Ada Generation", "NVIDIA RTX 6000D"):
        assert type_of_card(name, 49152) != "RTXPro6000"
    assert type_of_card(RTX_PRO_6000_WS[0], RTX_PRO_6000_WS[2]) == "RTXPro6000"
