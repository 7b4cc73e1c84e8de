"""What SLURM's variables say beyond the rank layout (detect.py): the rendezvous port of a job step, and
the job-script mistakes that would otherwise hang or waste cards, as one error naming the #SBATCH line.

Every function reads an environment mapping, so tests pass a dict.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

from levers9.errors import LauncherEnvError

PORT_BASE = 10000
PORT_SPAN = 20000  # 10000-29999: below Linux's ephemeral range (32768-60999), so no outgoing socket holds it
_STEP_STRIDE = 7919  # a prime: steps 1-9 of a job land thousands of ports away from the next job ids
_SPECIAL_STEPS = 0xFFFFFFF0  # SLURM's own step ids (batch, extern, interactive) as unsigned numbers, and above


def master_port(env: Mapping[str, str]) -> int | None:
    """The port rank 0 listens on for this job step, from SLURM_JOB_ID and SLURM_STEP_ID (None outside a job).

    Jobs sharing a node have different ids, and neighbouring ids (the likely neighbours) get neighbouring
    ports; two steps of one job running at once (`srun ... &` twice) differ by the step's stride. Two jobs
    share a port only if their ids differ by a multiple of 20000 less the step offsets, and share a node.
    """
    job_id = env.get("SLURM_JOB_ID", "")
    if not job_id.isdigit():
        return None
    return PORT_BASE + (int(job_id) + _STEP_STRIDE * (step_id(env) or 0)) % PORT_SPAN  # the batch step's as step 0


def step_id(env: Mapping[str, str]) -> int | None:
    """The srun job step this process is a task of (0, 1, ...), from SLURM_STEP_ID (SLURM_STEPID before 20.11);
    None outside a step. SLURM 24 and later give the job script itself a step id too, -5 (its batch step), and
    the extern step -4: neither is srun's."""
    value = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or ""
    step = int(value) if value.isdigit() else None  # "-5", "-4": the batch and extern steps, as SLURM 24+ writes them
    return step if step is not None and step < _SPECIAL_STEPS else None


def check_started_by_srun(env: Mapping[str, str]) -> None:
    """Raise if this process is an sbatch script's own (no job step) in a job that asked for several tasks:
    `python train.py` without `srun` runs once where the script asked SLURM for many tasks."""
    if "SLURM_JOB_ID" not in env or step_id(env) is not None:
        return
    tasks = env.get("SLURM_NTASKS", "1")
    nodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1"
    if not (tasks.isdigit() and nodes.isdigit()) or (int(tasks) <= 1 and int(nodes) <= 1):
        return
    per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or tasks
    raise LauncherEnvError(
        f"SLURM job {env['SLURM_JOB_ID']} asked for {tasks} task(s) on {nodes} node(s) (SLURM_NTASKS={tasks}, "
        f"SLURM_JOB_NUM_NODES={nodes}), but this process was not started by srun (no SLURM_STEP_ID): it is the "
        f"job script itself, one process where {tasks} were meant. Expected each task started by srun: write "
        f"`srun python {_script_hint()}` in the job script (ranks come from `#SBATCH --ntasks-per-node={per_node}`), "
        f"or, on one node, change to `#SBATCH --ntasks-per-node=1` and `#SBATCH --nodes=1` and let distributed.run "
        f"start one rank per card."
    )


def check_tasks_match_cards(env: Mapping[str, str], local_world_size: int) -> None:
    """Raise if SLURM gave this node's tasks a number of cards that is neither one per task (each task
    sees 1 card: --gpus-per-task=1) nor the node's task count (each task sees them all, a rank per card)."""
    on_node = env.get("SLURM_GPUS_ON_NODE", "")
    visible = [c for c in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if c.strip()]
    if not on_node.isdigit() or not visible or len(visible) == local_world_size:
        return
    if len(visible) == 1 and int(on_node) >= local_world_size:
        return  # a card of its own per task
    cards, tasks = min(len(visible), int(on_node)), local_world_size
    problem = (f"{cards - tasks} card(s) would sit idle" if cards > tasks
               else f"{tasks - cards} rank(s) would share a card with another")
    raise LauncherEnvError(
        f"SLURM gave each of this node's {tasks} task(s) the same {cards} card(s) (CUDA_VISIBLE_DEVICES="
        f"{env.get('CUDA_VISIBLE_DEVICES')}, SLURM_GPUS_ON_NODE={on_node}, {tasks} task(s) per node): {problem}. "
        f"Expected one task per card: change `#SBATCH --ntasks-per-node={tasks}` to "
        f"`#SBATCH --ntasks-per-node={cards}`, or `#SBATCH --gres=gpu:{cards}` to `#SBATCH --gres=gpu:{tasks}`."
    )


def _script_hint() -> str:
    """This process's command line (what the job script ran), for the message's `srun python ...`."""
    return " ".join(sys.argv) if sys.argv and sys.argv[0] else "train.py"
