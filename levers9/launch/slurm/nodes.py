"""The SLURM cluster as `sinfo` (and its accounting, `sacctmgr`) shows it, and how a job's cards are asked of it
(used by the backend and `levers9 doctor`; imports no submitit)."""

from __future__ import annotations

import dataclasses
import math
import os
import pwd
import shutil
import subprocess

from levers9.errors import InfeasibleJobError, JobConfigError
from levers9.launch.spec import JobSpec

ARRAY_LIMIT = 256  # the default concurrency limit of a map when the cluster's size gives none smaller


@dataclasses.dataclass(frozen=True)
class SlurmNode:
    """A node as `sinfo -N` lists it: its name, its GPUs (GRES gpu), its CPUs and partition(s)."""

    name: str
    cards: int
    cpus: int
    partition: str  # 'gpu', or 'gpu, preempt' for a node of several
    state: str
    types: tuple[tuple[str, int], ...] = ()  # (GRES type as the cluster names it, cards): (("a100", 4),)

    def describe(self) -> str:
        kinds = "+".join(f"{n} {t}" for t, n in self.types if t)
        return f"{self.name} ({self.cards} GPU(s){f' ({kinds})' if kinds else ''}, {self.cpus} CPU(s), {self.state})"

    def cards_of(self, gpu_type: str) -> tuple[str, int]:
        """(the cluster's name for `gpu_type`, how many of those cards this node has); ('', cards) for any type."""
        if not gpu_type:
            return "", self.cards
        for name, count in self.types:
            if name and canonical_type(name) == gpu_type:
                return name, count
        return "", 0


def canonical_type(gres_type: str) -> str | None:
    """levers9's name for a cluster's GRES type ('a100' -> 'A100-40', 'h100' -> 'H100'); None when unknown."""
    from levers9.distributed.hardware.gpu_types import parse_gpu_type

    try:
        return parse_gpu_type(gres_type)
    except JobConfigError:
        return None


def _gres_types(gres: str) -> tuple[tuple[str, int], ...]:
    """(type, GPUs) in sinfo's %G: 'gpu:2' -> (('', 2),), 'gpu:a100:4(S:0-1),gpu:v100:2' -> (('a100', 4), ('v100', 2));
    () for '(null)'."""
    found = []
    for part in gres.split(","):
        fields = part.split("(")[0].split(":")
        if fields[0] == "gpu" and len(fields) >= 2 and fields[-1].isdigit():
            found.append((fields[1] if len(fields) >= 3 else "", int(fields[-1])))
    return tuple(found)


def _gres_gpus(gres: str) -> int:
    """GPUs in sinfo's %G: 'gpu:2', 'gpu:a100:4(S:0-1)', 'gpu:a100:4,gpu:v100:2'; 0 for '(null)'."""
    return sum(count for _, count in _gres_types(gres))


def cluster_nodes(partition: str | None) -> list[SlurmNode]:
    """The nodes of `partition` (all partitions when None), from sinfo; JobConfigError if sinfo cannot answer."""
    command = ["sinfo", "-h", "-N", "-o", "%N|%G|%c|%P|%t"] + (["-p", partition] if partition else [])
    done = _slurm(command, "read the cluster's nodes")
    if partition and not done.stdout.strip():  # sinfo answers nothing for a partition that does not exist
        check_partitions(partition)
    nodes: dict[str, SlurmNode] = {}
    for line in done.stdout.splitlines():
        name, gres, cpus, part, state = (line.split("|") + ["", "", "", "", ""])[:5]
        if name in nodes:  # a node of several partitions is one node, in each of them
            partitions = sorted({*nodes[name].partition.split(", "), part.rstrip("*")})  # sorted: sinfo lists them in no set order
            nodes[name] = dataclasses.replace(nodes[name], partition=", ".join(partitions))
        elif name:
            nodes[name] = SlurmNode(name, _gres_gpus(gres), int(cpus) if cpus.isdigit() else 1, part.rstrip("*"), state,
                                    _gres_types(gres))  # fmt: skip
    return list(nodes.values())


def check_partitions(partition: str) -> None:
    """JobConfigError naming the cluster's partitions if `partition` (one, or several with commas) names one that
    does not exist; before anything is submitted."""
    known = sorted({line.strip().rstrip("*") for line in _slurm(["sinfo", "-h", "-o", "%R"], "list the partitions")
                    .stdout.splitlines() if line.strip()})  # fmt: skip
    missing = [name for name in partition.split(",") if name.strip() and name.strip() not in known]
    if missing:
        raise JobConfigError(
            f"slurm={{'partition': {partition!r}}}: this cluster has no partition {', '.join(map(repr, missing))}; its "
            f"partitions are: {', '.join(known) or 'none'} (sinfo). Set slurm={{'partition': ...}} (or partition in the "
            f"[slurm] table of workspace.toml) to one of them, or leave it out for the cluster's default."
        )


def check_account_and_qos(account: str | None, qos: str | None) -> None:
    """JobConfigError naming what SLURM's accounting lets this user charge, if `account` or `qos` is not among it;
    before anything is submitted. Checked only where the cluster enforces them (AccountingStorageEnforce): without
    accounting SLURM ignores both, and sbatch is the judge."""
    if not (account or qos) or shutil.which("sacctmgr") is None:
        return
    shown = _slurm(["scontrol", "show", "config"], "read the cluster's settings").stdout.splitlines()
    config = {key.strip(): value.strip() for key, _, value in (line.partition(" = ") for line in shown) if value}
    enforced = set(config.get("AccountingStorageEnforce", "").split(","))
    if not enforced & {"associations", "limits", "qos", "safe"}:
        return
    try:
        user = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:  # a uid with no passwd entry (a container's): SLURM's accounting knows it by none either
        return
    try:
        listed = subprocess.run(["sacctmgr", "-nP", "show", "assoc", "where", f"user={user}",
                                 f"cluster={config.get('ClusterName', '')}", "format=account,qos"],
                                capture_output=True, text=True, timeout=60)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return  # slurmdbd too slow or sacctmgr not runnable: sbatch answers for itself
    if listed.returncode != 0:  # slurmdbd unreachable: the same
        return
    charges = [line.split("|") + [""] for line in listed.stdout.splitlines() if line.strip()]
    accounts = sorted({fields[0] for fields in charges})
    where = f"(sacctmgr show assoc where user={user})"
    if account and account not in accounts:
        raise JobConfigError(
            f"slurm={{'account': {account!r}}}: SLURM's accounting lets user {user} charge no account {account!r}; "
            f"the accounts {user} may use are: {', '.join(accounts) or 'none'} {where}. Set slurm={{'account': ...}} "
            f"(or account in the [slurm] table of workspace.toml) to one of them, or leave it out for your default "
            f"account; an account you should be in is added by the cluster's admins."
        )
    if qos and "qos" in enforced:
        allowed = sorted({name for fields in charges if not account or fields[0] == account
                          for name in fields[1].split(",") if name})  # fmt: skip
        if qos not in allowed:
            under = f" under account {account!r}" if account else ""
            raise JobConfigError(
                f"slurm={{'qos': {qos!r}}}: SLURM's accounting lets user {user} use no QOS {qos!r}{under}; the QOS "
                f"allowed are: {', '.join(allowed) or 'none'} {where}. Set slurm={{'qos': ...}} (or qos in the [slurm] "
                f"table of workspace.toml) to one of them, or leave it out for your account's default QOS."
            )


def _slurm(command: list[str], what: str) -> subprocess.CompletedProcess[str]:
    """Run a SLURM command; JobConfigError with its own words if it is missing or fails."""
    if shutil.which(command[0]) is None:
        raise JobConfigError(
            f"backend='slurm' needs SLURM's commands, but {command[0]} is not on PATH. Expected to run on a "
            f"SLURM login node (sbatch, squeue, scancel, sinfo); use backend='local' elsewhere."
        )
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise JobConfigError(
            f"`{' '.join(command)}` failed (exit {done.returncode}) when trying to {what}: {done.stderr.strip()}. "
            f"Check the partition, account and qos (@job(slurm={{...}}) or [slurm] in workspace.toml) and SLURM_CONF."
        )
    return done


@dataclasses.dataclass(frozen=True)
class SlurmPlan:
    """How a job's cards are asked of SLURM: `nodes` nodes, `tasks` tasks with `cards` GPUs on each node."""

    nodes: int
    tasks: int  # tasks per node
    cards: int  # GPUs per node
    gres_type: str = ""  # the cluster's name of the cards' type ('a100'), '' for any

    @property
    def gres(self) -> str:
        """--gres's value: 'gpu:a100:4', or 'gpu:4' for any type."""
        return f"gpu:{self.gres_type}:{self.cards}" if self.gres_type else f"gpu:{self.cards}"

    def where(self, node: str, job_id: str) -> str:
        """What the status line says a running job holds: '2 on l9node1 (SLURM job 28)', 'no card on l9node2 (SLURM job 29)'."""
        if not self.cards:
            return f"no card on {node or '?'} (SLURM job {job_id})"
        split = f"{self.nodes * self.cards} as {self.nodes} nodes x {self.cards}" if self.nodes > 1 else str(self.cards)
        return f"{split} on {node or '?'} (SLURM job {job_id})"


# SLURM's pending reasons (squeue %r) a user meets most, in words; any other is shown as SLURM gives it.
PENDING_WORDS = {
    "Resources": "",  # the want itself says it
    "Priority": "jobs of higher priority come first",
    "QOSMaxGRESPerUser": "your QOS's limit on cards per user is reached",
    "QOSMaxJobsPerUserLimit": "your QOS's limit on jobs per user is reached",
    "AssocGrpGRES": "your account's limit on cards is reached",
    "JobArrayTaskLimit": "the array's limit of cells at once is reached",
    "ReqNodeNotAvail": "a node it needs is down, drained or reserved",
    "PartitionNodeLimit": "it asks more nodes than the partition allows",
    "BeginTime": "its start time has not come",
    "Dependency": "it waits for another job",
}


def pending_words(plan: SlurmPlan, reason: str) -> str:
    """What a pending job waits for, in words, with SLURM's reason: 'waiting for 8 free cards on one node: Resources'."""
    if not plan.cards:
        want = "CPU slot"
    elif plan.nodes == 1:
        want = f"{plan.cards} free card{'s' if plan.cards > 1 else ''} on one node"
    else:
        want = f"{plan.nodes} nodes with {plan.cards} free cards each"
    code = reason.strip("()").split(",")[0]  # "(ReqNodeNotAvail, UnavailableNodes:n2)" -> "ReqNodeNotAvail"
    if code in ("", "None"):
        return f"waiting for {want}: queued"
    words = PENDING_WORDS.get(code)
    if words is None or code == "Resources":
        return f"waiting for {want}: {reason}"
    return f"waiting for {want}; {words.format(want=want)}: {reason}"


def plan_job(spec: JobSpec, nodes: list[SlurmNode], partition: str | None) -> SlurmPlan:
    """One node with all the cards when some node has them; else the fewest nodes with equal shares, one task
    per card (srun starts every rank: no levers9 agent runs there); InfeasibleJobError naming the nodes when no
    such split exists."""
    n = spec.gpu_count
    if n == 0:
        return SlurmPlan(1, 1, 0)
    where = f"partition {partition!r}" if partition else "the cluster"
    wanted = tuple(t for t in spec.gpu_types if t != "any")
    held = {t: [node.cards_of(t) for node in nodes] for t in wanted or ("",)}  # type -> (its name, cards) per node
    for cards in held.values():  # one node of any type asked for, before a split of the first that splits
        name = next((name for name, count in cards if count >= n), None)
        if name is not None:
            return SlurmPlan(1, 1, n, name)
    for cards in held.values():
        name = next((name for name, count in cards if count), "")
        for k in range(2, len(nodes) + 1):
            share = n // k
            if n % k == 0 and sum(count >= share for _, count in cards) >= k:
                return SlurmPlan(k, share, share, name)
    if wanted and not any(node.cards_of(t)[1] for node in nodes for t in wanted):
        types = sorted({f"{t} ({canonical_type(t) or 'not a type levers9 knows'})" for node in nodes
                        for t, _ in node.types if t})  # fmt: skip
        raise InfeasibleJobError(
            f"Job {spec.name!r} asks for gpu={'/'.join(wanted)!r}, and no node of {where} has that type: its cards "
            f"are {', '.join(types) or 'declared without a type (gres.conf has no Type=)'}. Ask for a type the "
            f"cluster has (@job(gpu=...)), leave gpu= out for any card, or pick another partition "
            f"(@job(slurm={{'partition': ...}}))."
        )
    listed = "; ".join(node.describe() for node in nodes) or "no node"
    raise InfeasibleJobError(
        f"Job {spec.name!r} needs {spec.describe_cards()}, and {where} can never hold them, not even split "
        f"into equal shares across nodes: {listed}. Ask for what the nodes have (gpu_count=), or another "
        f"partition (@job(slurm={{'partition': ...}}))."
    )


def capacity(plan: SlurmPlan, spec: JobSpec, nodes: list[SlurmNode]) -> int:
    """How many cells of this plan the nodes could run at once (at least 1)."""
    if plan.cards:
        fits = sum(node.cards_of(canonical_type(plan.gres_type) or "")[1] // plan.cards for node in nodes) // plan.nodes
    else:
        fits = sum(node.cpus // max(1, math.ceil(spec.cpu or 1)) for node in nodes)
    return max(1, min(ARRAY_LIMIT, fits))


def report(gpu_count: int | None, partition: str | None) -> str:
    """`levers9 doctor`'s SLURM section: each node's partition, cards (in use now), CPUs and state; with
    `gpu_count`, the #SBATCH lines @job(gpu_count=N, backend="slurm") would submit, or why it could not."""
    nodes = cluster_nodes(partition)
    used = _gres_in_use(partition)
    lines = [f"  {n.name} ({n.partition}): {n.cards} GPU(s), {max(0, n.cards - used.get(n.name, 0))} free; "
             f"{n.cpus} CPU(s); {n.state}" for n in nodes] or ["  no node"]  # fmt: skip
    if gpu_count is not None:
        try:
            plan = plan_job(JobSpec("doctor", gpu_count=gpu_count), nodes, partition)
        except InfeasibleJobError as exc:
            lines.append(f"  gpu_count={gpu_count}: {exc}")
        else:
            sbatch = [f"--nodes={plan.nodes}", f"--ntasks-per-node={plan.tasks}"] + ([f"--gres={plan.gres}"] if plan.cards else [])
            sbatch += [f"--partition={partition}"] if partition else []
            lines.append(f"  gpu_count={gpu_count} would be: " + " ".join(f"#SBATCH {flag}" for flag in sbatch)
                         + ("" if plan.nodes == 1 else f" (srun starts {plan.nodes * plan.tasks} ranks)"))  # fmt: skip
    return "\n".join(lines)


def _gres_in_use(partition: str | None) -> dict[str, int]:
    """node -> GPUs allocated now (sinfo's GresUsed: 'gpu:1(IDX:0)')."""
    command = ["sinfo", "-h", "-N", "-O", "NodeList:200,GresUsed:200"] + (["-p", partition] if partition else [])
    done = _slurm(command, "read the cards in use")
    used: dict[str, int] = {}
    for line in done.stdout.splitlines():
        fields = line.split()
        if len(fields) >= 2:
            used[fields[0]] = _gres_gpus(fields[1])
    return used
