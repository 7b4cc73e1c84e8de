"""GPU type names: NVML's names (as drivers report them) to the controlplane's spellings, and users' spellings."""

from __future__ import annotations

import pytest

from levers9.distributed.hardware.gpu_types import (
    GPU_TYPES,
    _key,
    _word_key,
    known_types,
    parse_gpu_type,
    type_of_card,
)
from levers9.errors import JobConfigError

pytestmark = pytest.mark.fast


@pytest.mark.parametrize(
    ("nvml_name", "memory_mib", "expected"),
    [
        ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", 97_887, "RTXPro6000"),
        ("NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition", 97_887, "RTXPro6000"),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", 97_887, "RTXPro6000"),
        ("NVIDIA RTX 6000D", 84_000, "RTX6000D"),
        ("NVIDIA RTX PRO 5000 Blackwell", 49_000, "RTXPro5000"),
        ("NVIDIA RTX PRO 5000 72GB Blackwell", 73_000, "RTXPro5000"),
        ("NVIDIA GeForce RTX 5090", 32_607, "RTX5090"),
        ("NVIDIA GeForce RTX 5090 D", 32_607, "RTX5090"),
        ("NVIDIA B200", 183_000, "B200"),
        ("NVIDIA GB200", 186_000, "GB200"),
        ("NVIDIA RTX 6000 Ada Generation", 49_140, "RTX6000Ada"),
        ("NVIDIA RTX A6000", 49_140, "A6000"),
        ("NVIDIA GeForce RTX 4090", 24_564, "RTX4090"),
        ("NVIDIA L40S", 46_068, "L40S"),
        ("NVIDIA H100 80GB HBM3", 81_559, "H100"),
        ("NVIDIA H200", 143_771, "H200"),
        ("NVIDIA A100-SXM4-80GB", 81_920, "A100-80"),
        ("NVIDIA A100-SXM4-40GB", 40_960, "A100-40"),
        ("Tesla T4", 15_360, "T4"),
        ("NVIDIA L4", 23_034, "L4"),
        ("NVIDIA A10G", 23_028, "A10G"),
        ("NVIDIA Mystery X1", 1_000, "MysteryX1"),
    ],
)
def test_nvml_names_become_type_names(nvml_name: str, memory_mib: int, expected: str) -> None:
    assert type_of_card(nvml_name, memory_mib) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("RTXPro6000", "RTXPro6000"), ("rtx-pro-6000", "RTXPro6000"), ("RTX-PRO-6000", "RTXPro6000"),
     ("A100-80GB", "A100-80"), ("a100_40gb", "A100-40"), ("h100", "H100"), ("RTX 4090", "RTX4090")],
)
def test_user_spellings(text: str, expected: str) -> None:
    assert parse_gpu_type(text) == expected


@pytest.mark.parametrize(("text", "suggestion"), [("RTX6000Pro", "RTXPro6000"), ("h1000", "H100"), ("L40SS", "L40S")])
def test_unknown_types_get_a_did_you_mean_and_the_known_list(text: str, suggestion: str) -> None:
    with pytest.raises(JobConfigError) as info:
        parse_gpu_type(text)
    assert f"Did you mean {suggestion!r}?" in str(info.value)
    assert all(name in str(info.value) for name in known_types())


@pytest.mark.parametrize("text", ["", "   ", None, 3])
def test_empty_or_non_text_is_refused(text: object) -> None:
    with pytest.raises(JobConfigError, match="gpu="):
        parse_gpu_type(text)  # type: ignore[arg-type]


def test_no_alias_is_a_spelling_the_lookup_already_reaches() -> None:
    """A lookup ignores case, spaces, dashes and underscores; an alias that differs from its name (or from
    another alias) only in those, words in the same order, changes no lookup, so the table keeps none."""
    for row in GPU_TYPES:
        seen = {(_key(row.name), _word_key(row.name))}
        for alias in row.aliases:
            assert parse_gpu_type(alias) == row.name
            assert (_key(alias), _word_key(alias)) not in seen, (row.name, alias)
            seen.add((_key(alias), _word_key(alias)))
