"""GPU type names: the hosted controlplane's spellings (`RTXPro6000`, `H100`, `A100-80`, ...).

`type_of_card(nvml_name, memory_mib)` turns what NVML reports into one of these names;
`parse_gpu_type(user_text)` accepts the spellings users write (including Modal's) and suggests a
close match for an unknown one. Both are pure functions over the table below.
"""

from __future__ import annotations

import dataclasses
import difflib
import re

from levers9.errors import JobConfigError


@dataclasses.dataclass(frozen=True)
class GpuType:
    """One card type: its canonical name, other spellings users write, and how NVML names it."""

    name: str
    aliases: tuple[str, ...]  # only spellings that case, spaces, dashes and underscores do not already reach
    nvml_pattern: str  # regular expression searched in the NVML name, case-insensitive
    min_memory_mib: int = 0  # for types told apart by memory (A100-40 / A100-80)


# Order matters: the first row whose pattern (and memory bound) matches names the card, so the more
# specific rows (RTX PRO 6000 before RTX 6000 Ada, A100-80 before A100-40) come first.
GPU_TYPES: tuple[GpuType, ...] = (
    GpuType("RTXPro6000", ("RTXPRO6000",), r"RTX PRO 6000"),
    GpuType("RTXPro5000", (), r"RTX PRO 5000"),
    GpuType("RTXPro4500", (), r"RTX PRO 4500"),
    GpuType("RTXPro4000", (), r"RTX PRO 4000"),
    GpuType("RTX6000D", (), r"RTX 6000D"),
    GpuType("RTX6000Ada", (), r"RTX 6000 Ada"),
    GpuType("RTX5880Ada", (), r"RTX 5880 Ada"),
    GpuType("A6000", ("RTXA6000", "RTX-A6000"), r"RTX A6000"),
    GpuType("RTX5090", ("5090",), r"GeForce RTX 5090"),
    GpuType("RTX5080", (), r"GeForce RTX 5080"),
    GpuType("RTX4090", ("4090",), r"GeForce RTX 4090"),
    GpuType("RTX4080", (), r"GeForce RTX 4080"),
    GpuType("RTX3090", ("3090",), r"GeForce RTX 3090"),
    GpuType("GB200", (), r"\bGB200\b"),
    GpuType("B200", (), r"\bB200\b"),
    GpuType("H200", (), r"\bH200\b"),
    GpuType("H100", ("H100-80", "H100-80GB"), r"\bH100\b"),
    GpuType("GH200", (), r"\bGH200\b"),
    GpuType("A100-80", ("A100-80GB",), r"\bA100\b", min_memory_mib=60_000),
    GpuType("A100-40", ("A100-40GB", "A100"), r"\bA100\b"),
    GpuType("L40S", (), r"\bL40S\b"),
    GpuType("L40", (), r"\bL40\b"),
    GpuType("L4", (), r"\bL4\b"),
    GpuType("A10G", (), r"\bA10G\b"),
    GpuType("A10", (), r"\bA10\b"),
    GpuType("T4", (), r"\bT4\b"),
    GpuType("V100", (), r"\bV100\b"),
)

def _key(text: str) -> str:
    """A spelling with case, spaces, dashes and underscores removed: 'RTX-PRO-6000' -> 'rtxpro6000'."""
    return re.sub(r"[\s_\-]", "", text).lower()


def _word_key(text: str) -> str:
    """The same with its words sorted, so 'RTX6000Pro' and 'RTXPro6000' meet."""
    words = re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", text)
    return "".join(sorted(word.lower() for word in words))


_BY_KEY: dict[str, str] = {}
_BY_WORDS: dict[str, str] = {}
for _row in GPU_TYPES:
    for _spelling in (_row.name, *_row.aliases):
        _BY_KEY[_key(_spelling)] = _row.name
        _BY_WORDS.setdefault(_word_key(_spelling), _row.name)


def known_types() -> list[str]:
    """The canonical type names, in table order."""
    return [row.name for row in GPU_TYPES]


def type_of_card(nvml_name: str, memory_mib: int = 0) -> str:
    """The canonical type of a card NVML calls `nvml_name`; an unknown card keeps a compact form of its name."""
    for row in GPU_TYPES:
        if re.search(row.nvml_pattern, nvml_name, re.IGNORECASE) and memory_mib >= row.min_memory_mib:
            return row.name
    compact = re.sub(r"^(NVIDIA|Tesla)\s+", "", nvml_name.strip(), flags=re.IGNORECASE)
    return re.sub(r"\s+", "", compact) or "unknown"


def parse_gpu_type(text: str) -> str:
    """The canonical name for a user's spelling (`"rtx-pro-6000"` → `"RTXPro6000"`), or a did-you-mean error."""
    if not isinstance(text, str) or not text.strip():
        raise JobConfigError(
            f"gpu={text!r} is not a GPU type. Expected one of: {', '.join(known_types())} (or gpu=None for a CPU job)."
        )
    key = _key(text)
    if key in _BY_KEY:
        return _BY_KEY[key]
    if _word_key(text) in _BY_WORDS:  # the right words in another order
        hint = f" Did you mean {_BY_WORDS[_word_key(text)]!r}?"
    else:
        close = difflib.get_close_matches(key, list(_BY_KEY), n=1, cutoff=0.6)
        hint = f" Did you mean {_BY_KEY[close[0]]!r}?" if close else ""
    raise JobConfigError(f"Unknown GPU type {text!r}.{hint} Known types: {', '.join(known_types())}.")
