"""Per-call checks, in beta9's order: the workspace's card cap, its multi-GPU switch, then feasibility.

`check_policy` is the same for every backend; `check_feasible` is the local executor's answer to
"could this machine ever hold the job?". Both raise before anything starts.
"""

from __future__ import annotations

from levers9.errors import InfeasibleJobError, WorkspacePolicyError
from levers9.launch.pool import SIMULATE_VAR, Pool
from levers9.launch.settings import Settings
from levers9.launch.spec import JobSpec


def check_policy(spec: JobSpec, settings: Settings) -> None:
    """WorkspacePolicyError if the job asks for more cards than the cap, or for several with the switch off."""
    if spec.gpu_count > settings.max_gpu_count:
        raise WorkspacePolicyError(
            f"GPU count must be {settings.max_gpu_count} or less (job {spec.name!r} asks for {spec.gpu_count}; "
            f"the limit is limits.max_gpu_count in {settings.path}). Ask for fewer cards, or raise the limit "
            f"with: levers9 workspace max-gpu-count {spec.gpu_count}"
        )
    if spec.gpu_count > 1 and not settings.multi_gpu:
        raise WorkspacePolicyError(
            f"Multi-GPU jobs are not enabled for this workspace (job {spec.name!r} asks for {spec.gpu_count} "
            f"cards; the switch is workspace.multi_gpu in {settings.path}, now off). Turn them on with: "
            f"levers9 workspace multi-gpu on"
        )


def check_feasible(spec: JobSpec, pool: Pool) -> list[list[int]]:
    """The slot groups the job may take from; InfeasibleJobError if no group could ever hold it."""
    want = spec.describe_cards()
    if pool.held_by:
        return _check_nested(spec, pool)
    if not pool.cards:
        raise InfeasibleJobError(
            f"Job {spec.name!r} asks for {want} but this machine has no NVIDIA GPU that levers9 can see "
            f"(NVML found none{', or CUDA_VISIBLE_DEVICES hides them' if pool.source == 'NVML' else ''}). "
            f"For tests, set {SIMULATE_VAR}='RTXPro6000:4' (or [local].simulate_gpus in workspace.toml); "
            f"for a CPU job, use gpu=None."
        )
    groups = [g for g in pool.groups(spec.gpu_types) if g]
    if not groups:
        have = pool.describe()
        first = next(iter(dict.fromkeys(c.type_name for c in pool.cards)))
        raise InfeasibleJobError(
            f"Job {spec.name!r} asks for {'/'.join(spec.gpu_types)} but this machine has {have}; "
            f"use gpu={first!r} or gpu='any'."
        )
    if max(len(g) for g in groups) < spec.gpu_count:
        raise InfeasibleJobError(
            f"Job {spec.name!r} needs {want} at once; the largest group of such cards on this machine has "
            f"{max(len(g) for g in groups)} (local machine: {pool.describe()}). Ask for at most that many "
            f"with gpu_count=, or run it where more cards are attached."
        )
    return groups


def _check_nested(spec: JobSpec, pool: Pool) -> list[list[int]]:
    """For a job started inside a job: its caller's cards must be able to hold it, or it fails now."""
    groups = [g for g in pool.groups(spec.gpu_types) if g]
    if groups and max(len(g) for g in groups) >= spec.gpu_count:
        return groups
    visible = ",".join(str(c.nvml_index) for c in pool.cards)
    raise InfeasibleJobError(
        f"Job {spec.name!r} asks for {spec.describe_cards()} but was started inside job {pool.held_by}, which "
        f"holds {pool.summary()} (CUDA_VISIBLE_DEVICES={visible}). A job started inside a job runs on its "
        f"caller's cards: the caller keeps its cards while it waits, so waiting for other cards could "
        f"deadlock (callers holding every card, each waiting for an inner job that needs one). Ask the inner "
        f"job for at most {pool.summary()} (gpu_count=, gpu=), give the outer job the cards the inner one "
        f"needs, or start the inner jobs from the top-level script rather than from inside a job."
    )
