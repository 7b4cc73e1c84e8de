"""The GPU-quirk rows: known card / NCCL / platform problems, one row of data each (what it matches, what
it does, the public evidence), and what the rows decide for one run (`QuirkPlan`, which the process's
Runtime keeps once applied). quirk_checks.py checks a row against a run; quirks.py plans and applies."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Literal

from levers9.errors import QuirkError

Action = Literal["set-env", "error", "warning", "info"]
Status = Literal["applies", "does not apply", "unknown", "disabled"]  # a row, for one run

log = logging.getLogger("levers9.quirks")


@dataclasses.dataclass(frozen=True)
class NcclKernels:
    """Which NCCL builds carry device code for cards with compute capability in [low, high)."""

    arch: str  # "sm_120"
    low: tuple[int, int]
    high: tuple[int, int]
    min_version: tuple[int, int, int]  # every build at or above this has the kernels
    min_version_cuda_12_8: tuple[int, int, int]  # a build made with CUDA >= 12.8 has them from here on
    good_wheels: tuple[str, ...]  # PyPI wheels below min_version that have them (the .post1 rebuilds)


@dataclasses.dataclass(frozen=True)
class Match:
    """What a row matches; every field that is set must hold. Card fields look at the cards in use."""

    name: str | None = None  # regex searched (case-insensitive) in the NVML name of a card in use
    min_capability: tuple[int, int] | None = None  # that card's compute capability at least this
    min_local_world_size: int = 2  # ranks on this node
    max_local_world_size: int | None = None
    backend: str | None = "nccl"  # the backend must include this; None matches any backend
    nvlink: bool | None = None  # NVLink joins the cards in use (True) / does not (False)
    p2p_reported: bool | None = None  # the driver reports P2P between the cards in use
    driver_below: tuple[int, ...] | None = None  # NVIDIA driver version lower than this
    driver_at_least: tuple[int, ...] | None = None
    platform: Literal["wsl2", "rocm"] | None = None
    shm_below_mib: int | None = None  # /dev/shm smaller than this
    env_unset: tuple[str, ...] = ()  # these variables are all absent
    kernel_cmdline_lacks: tuple[str, ...] = ()  # none of these words is on /proc/cmdline
    nccl_lacks: tuple[NcclKernels, ...] = ()  # the NCCL in use lacks kernels for a card in use


@dataclasses.dataclass(frozen=True)
class Quirk:
    """One row of the registry."""

    id: str  # stable; what LEVERS9_DISABLE_QUIRKS names
    description: str  # what goes wrong, for the user
    match: Match
    action: Action
    set_env: Mapping[str, str] = dataclasses.field(default_factory=dict)  # for action "set-env"
    fix: str = ""  # what the user can do about it (the real fix, or the command)
    evidence: tuple[str, ...] = ()  # owner/repo#N, docs URLs
    notes: str = ""  # why the row is what it is (thresholds, choices), for readers and doctor


# Blackwell kernels in NCCL. "NCCL before 2.26" is not the line: the PyPI wheel
# nvidia-nccl-cu12==2.26.2 (what torch 2.7 pins) was built with CUDA 12.2 and has no sm_100/sm_120
# code, while 2.26.2.post1 is the same source rebuilt with CUDA 12.8. sm_120 also needs the
# shared-memory fix of 2.26.2, so 2.25.1(.post1) is fine on B200 but not on RTX 50xx / RTX PRO 6000.
# From 2.26.5 on every PyPI build has both; nvidia-nccl-cu13 starts at 2.27.7.
SM_100 = NcclKernels("sm_100", (10, 0), (12, 0), (2, 26, 5), (2, 25, 1), ("2.25.1.post1", "2.26.2.post1"))
SM_120 = NcclKernels("sm_120", (12, 0), (99, 0), (2, 26, 5), (2, 26, 2), ("2.26.2.post1",))

_P2P_ROOT_CAUSE = (
    "The usual root cause is the IOMMU or PCIe ACS redirecting peer traffic; the real fix is `iommu=pt` "
    "on the kernel command line, or VT-d/IOMMU and ACS off in the BIOS. Then set NCCL_P2P_DISABLE=0 to "
    "get P2P back (levers9 leaves a variable you set alone)."
)

QUIRKS: tuple[Quirk, ...] = (
    Quirk(
        id="blackwell-nccl-kernels",
        description=(
            "NCCL without kernels for Blackwell cards: the first collective fails with "
            "\"Cuda failure 1 'invalid argument'\" (or hangs) after the rings connect."
        ),
        match=Match(min_local_world_size=1, nccl_lacks=(SM_100, SM_120)),
        action="error",
        fix=(
            'pip install -U "nvidia-nccl-cu12>=2.26.5" (pip warns that torch 2.7 pins nvidia-nccl-cu12==2.26.2; '
            'torch loads the newer library anyway), or upgrade torch: pip install -U "torch>=2.8" (pins NCCL '
            "2.27.3). A CUDA 11 build of torch has no Blackwell NCCL at all: install a CUDA 12.8+ build of torch."
        ),
        evidence=(
            "NVIDIA/nccl v2.25.1-1 and v2.26.2-1 release notes",
            "NVIDIA/nccl-tests#287",
            "NVIDIA/nccl-tests#291",
            "NVIDIA/nccl#1637",
            "pytorch/pytorch#151002",
            "vllm-project/vllm#20862",
        ),
        notes=(
            "Threshold: sm_120 passes with NCCL >= 2.26.5, the 2.26.2.post1 wheel, or any build made with CUDA "
            ">= 12.8 from 2.26.2 on; sm_100 with >= 2.26.5, the 2.25.1.post1 / 2.26.2.post1 wheels, or a CUDA "
            ">= 12.8 build from 2.25.1 on. Not 'before 2.26': the 2.26.2 PyPI wheel (torch 2.7's pin) "
            "was built with CUDA 12.2 and has no Blackwell code. The version comes from "
            "ncclGetVersion of the library actually loaded, not torch.cuda.nccl.version() (compile-time)."
        ),
    ),
    Quirk(
        id="rtxpro6000-p2p",
        description=(
            "RTX PRO 6000 Blackwell cards without NVLink: the driver reports PCIe P2P as working, yet "
            "NCCL's first all_reduce can hang (and wedge the cards until a reset) on hosts with IOMMU/ACS on."
        ),
        match=Match(name=r"RTX PRO 6000", min_capability=(12, 0), nvlink=False),
        action="set-env",
        set_env={"NCCL_P2P_DISABLE": "1"},
        fix=_P2P_ROOT_CAUSE
        + " Cost: collectives go through shared memory (roughly 25-50% less bus bandwidth).",
        evidence=(
            "NVIDIA/nccl#1999",
            "local-inference-lab/rtx6kpro#15",
            "vllm-project/vllm#33041",
            "NVIDIA/cuda-samples#390",
            "NVIDIA/nccl#2079",
        ),
    ),
    Quirk(
        id="geforce-p2p-old-driver",
        description=(
            "GeForce RTX 40/50 cards on a driver older than 550.40.07: the driver reports P2P that the cards "
            "do not have, and all_reduce hangs at ~99% GPU use."
        ),
        match=Match(name=r"GeForce RTX (40|50)\d\d", driver_below=(550, 40, 7)),
        action="set-env",
        set_env={"NCCL_P2P_DISABLE": "1"},
        fix="Upgrade the NVIDIA driver to 550.40.07 or newer (it reports no P2P and NCCL uses shared memory).",
        evidence=("NVIDIA/nccl-tests#117", "huggingface/accelerate#2195", "huggingface/accelerate#2558"),
        notes="accelerate's rule (RTX 40 + driver < 550.40.07), extended to RTX 50 (same GeForce policy).",
    ),
    Quirk(
        id="geforce-p2p-patched",
        description=(
            "The driver reports P2P between GeForce RTX 40/50 cards, which NVIDIA does not support: this "
            "looks like a patched 'p2p' kernel module, which needs `iommu=pt` or gives hangs / NaN results."
        ),
        match=Match(name=r"GeForce RTX (40|50)\d\d", driver_at_least=(550, 40, 7), p2p_reported=True),
        action="warning",
        fix="If collectives hang or results are wrong, set NCCL_P2P_DISABLE=1 or boot with `iommu=pt`.",
        evidence=("NVIDIA/nccl-tests#287", "NVIDIA/nccl#1637", "tinygrad/open-gpu-kernel-modules#18"),
    ),
    Quirk(
        id="ada-p2p",
        description=(
            "Professional Ada cards (RTX 6000 Ada, RTX 5880 Ada, L40S), 2 to 7 on one node: PCIe P2P "
            "deadlocks all_reduce on hosts with ACS on."
        ),
        match=Match(name=r"RTX 6000 Ada|RTX 5880 Ada|\bL40S\b", max_local_world_size=7),
        action="set-env",
        set_env={"NCCL_P2P_DISABLE": "1"},
        fix=_P2P_ROOT_CAUSE,
        evidence=("axolotl-ai-cloud/axolotl#2041", "axolotl-ai-cloud/axolotl#2044", "NVIDIA/nccl#2079"),
        notes="axolotl's historical rule (1 < n < 8); `levers9 doctor --probe` tests P2P for real.",
    ),
    Quirk(
        id="shm-too-small",
        description=(
            "/dev/shm is smaller than 1 GiB (Docker's default is 64 MiB): NCCL fails to create its "
            'shared-memory segments ("Error while creating shared memory segment", or SIGBUS).'
        ),
        match=Match(shm_below_mib=1024, env_unset=("NCCL_SHM_DISABLE",)),
        action="error",
        fix=(
            "docker run --shm-size=1g --ulimit memlock=-1 ... ; on Kubernetes mount an emptyDir with "
            "`medium: Memory` at /dev/shm; or set NCCL_SHM_DISABLE=1 (slower: NCCL falls back to sockets)."
        ),
        evidence=(
            "https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/troubleshooting.html",
            "NVIDIA/nccl#290",
            "NVIDIA/nccl#342",
            "pytorch/torchtitan#853",
            "NVIDIA/JAX-Toolbox#183",
        ),
    ),
    Quirk(
        id="wsl2-p2p",
        description="WSL2 with more than one card: P2P between cards does not work reliably under WSL2.",
        match=Match(platform="wsl2"),
        action="set-env",
        set_env={"NCCL_P2P_DISABLE": "1"},
        fix=(
            "If NCCL then fails creating /dev/shm segments, set NCCL_SHM_DISABLE=1 (slow socket transport); "
            "multi-card training is more reliable on native Linux."
        ),
        evidence=("microsoft/WSL#12467", "NVIDIA/nccl#442", "NVIDIA/nccl#511", "pytorch/pytorch#152302"),
    ),
    Quirk(
        id="rocm-fine-grain-pcie",
        description="AMD ROCm cards on PCIe: RCCL warns of low performance or hangs without fine-grained PCIe memory.",
        match=Match(platform="rocm"),
        action="set-env",
        set_env={"HSA_FORCE_FINE_GRAIN_PCIE": "1"},
        fix="If collectives still hang, set NCCL_P2P_DISABLE=1 (RCCL reads the same variables).",
        evidence=("RCCL src/init.cc", "ROCm/rccl#1129", "ROCm/vllm#390"),
    ),
    Quirk(
        id="rocm-iommu-pt",
        description="AMD ROCm with more than one card and no `iommu=pt` on the kernel command line: RCCL can hang.",
        match=Match(platform="rocm", kernel_cmdline_lacks=("iommu=pt",)),
        action="warning",
        fix="Add iommu=pt to GRUB_CMDLINE_LINUX in /etc/default/grub, run update-grub and reboot.",
        evidence=("RCCL src/init.cc", "ROCm install FAQ, Issue #5", "ROCm/vllm#390"),
    ),
    Quirk(
        id="finite-init-timeout",
        description=(
            "levers9 passes a finite timeout to init_process_group (distributed.run's timeout=, else "
            "LEVERS9_PG_TIMEOUT seconds, else 600 s), so a hung first collective ends in an error naming the "
            "rank; it leaves TORCH_NCCL_ASYNC_ERROR_HANDLING at torch's default (3) and does not set "
            "TORCH_NCCL_BLOCKING_WAIT."
        ),
        match=Match(min_local_world_size=1, backend=None),
        action="info",
        fix="For a quicker verdict on a suspected hang, run `levers9 doctor --probe` (60 s per attempt).",
        evidence=("pytorch docs torch_nccl_environment_variables.rst", "pytorch ProcessGroupNCCL.hpp"),
    ),
)


# --- what the rows decide for one run (quirks.py makes it) ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class QuirkOutcome:
    """What one row decided for one plan (doctor shows these)."""

    quirk: Quirk
    status: Status
    detail: str  # what matched, or the first condition that did not
    set_env: Mapping[str, str] = dataclasses.field(default_factory=dict)  # set by this row
    kept: Mapping[str, str] = dataclasses.field(default_factory=dict)  # already set by the user, left alone
    message: str = ""  # the error / warning / applied sentence when it applies

    def says(self, action: str) -> bool:
        """True when the row applies and its action is `action`."""
        return self.status == "applies" and self.quirk.action == action


@dataclasses.dataclass(frozen=True)
class QuirkPlan:
    """What the registry decided for one run: one outcome per row; the rest is derived from them."""

    outcomes: tuple[QuirkOutcome, ...] = ()

    @property
    def set_env(self) -> dict[str, str]:
        """The defaults to set: every applying row's variables, the first row to name one winning."""
        env: dict[str, str] = {}
        for o in self.outcomes:
            for key, value in o.set_env.items():
                env.setdefault(key, value)
        return env

    @property
    def errors(self) -> list[str]:
        """The messages of applying "error" rows."""
        return [o.message for o in self.outcomes if o.says("error")]

    @property
    def warnings(self) -> list[str]:
        """The messages of applying "warning" rows, and a line for each error or warning row that could not be checked."""
        out = []
        for o in self.outcomes:
            if o.says("warning"):
                out.append(o.message)
            elif o.status == "unknown" and o.quirk.action in ("error", "warning"):
                out.append(f"[{o.quirk.id}] could not be checked: {o.detail}. {o.quirk.description}")
        return out

    @property
    def applied(self) -> list[tuple[str, str]]:
        """(id, sentence) of each "set-env" row that set something."""
        return [(o.quirk.id, o.message) for o in self.outcomes if o.says("set-env") and o.set_env]

    def raise_errors(self) -> None:
        """Raise QuirkError with every error message, if there are any."""
        if self.errors:
            raise QuirkError("\n\n".join(self.errors))

    def log(self) -> None:
        """One WARNING line per quirk that set something and per warning, on levers9.quirks: a changed NCCL
        setting is something a user must hear about without configuring logging."""
        for _, sentence in self.applied:
            log.warning("%s", sentence)
        for warning in self.warnings:
            log.warning("%s", warning)
        for o in self.outcomes:
            if o.says("set-env") and o.kept and not o.set_env:
                log.debug("%s", o.message)
