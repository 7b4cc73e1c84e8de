"""`levers9 doctor`: what levers9 sees on this machine and what it would do about it.

The launcher and rank, torch and CUDA versions, the cards (with their P2P / NVLink matrix), the NCCL
actually loaded, /dev/shm, the platform, and every quirk row: applies or not, and what it sets or
would raise. `--json` prints the same as one JSON object. `--probe` runs a short all_reduce across the
visible cards in child processes (never in this one), time-limited, and on a hang or failure retries
with the settings that usually fix it, saying which one did.

Exit status: 0 when nothing is wrong (also on a machine without cards); 1 when a quirk would raise
or the probe failed with every setting.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

from levers9 import distributed as dist
from levers9.distributed import detect
from levers9.distributed.hardware import cards as _cards
from levers9.distributed.hardware import nccl as _nccl
from levers9.distributed.hardware import quirks as _quirks
from levers9.distributed.hardware.quirk_checks import read_platform, size_text
from levers9.errors import Levers9Error

PROBE_TIMEOUT_S = 60.0
# Tried in order until one works: how levers9 runs it, then the settings that fix most hangs.
PROBE_ATTEMPTS: tuple[tuple[str, dict[str, str]], ...] = (
    ("as levers9 runs it", {}),
    ("NCCL_P2P_DISABLE=1", {"NCCL_P2P_DISABLE": "1"}),
    ("NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1", {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}),
    ("NCCL_CUMEM_HOST_ENABLE=0", {"NCCL_CUMEM_HOST_ENABLE": "0"}),
)
_REPORTED_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "CUDA_", "HSA_", "LEVERS9_")


def register(subparsers: Any) -> None:
    """Add `levers9 doctor` to the command line."""
    p = subparsers.add_parser(
        "doctor",
        help="show cards, NCCL, launcher and the GPU quirks levers9 applies here",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--probe", action="store_true", help="run a short all_reduce across the visible cards")
    p.add_argument("--probe-timeout", type=float, default=PROBE_TIMEOUT_S, metavar="S",
                   help="seconds per attempt")
    p.add_argument("--nprocs", type=int, help="ranks on this node to plan for (default: one per card)")
    p.add_argument(
        "--ray-plan", metavar="GPU:N",
        help="how a job of N cards of type GPU would be placed on the Ray cluster (RAY_ADDRESS, or a local Ray)",
    )  # fmt: skip
    p.add_argument(
        "--slurm-plan", type=int, metavar="N",
        help="the #SBATCH lines @job(gpu_count=N, backend='slurm') would submit (SLURM_CONF's cluster)",
    )  # fmt: skip
    p.add_argument("--partition", help="the SLURM partition to show (default: all)")
    p.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    """Collect, print, optionally probe; the exit status."""
    if not args.probe_timeout > 0:
        print(
            f"levers9 doctor: --probe-timeout {args.probe_timeout:g}; expected a positive number of seconds (default 60).",
            file=sys.stderr,
        )
        return 2
    report = collect(nprocs=args.nprocs)
    if args.ray_plan:
        report["ray_plan"] = _ray_plan(args.ray_plan)
    login_node = shutil.which("sinfo") and (os.environ.get("SLURM_CONF") or os.path.exists("/etc/slurm/slurm.conf"))
    if login_node or args.slurm_plan is not None:
        report["slurm"] = _slurm(args.slurm_plan, args.partition)
    if args.probe:
        report["probe"] = probe(len(report["cards"]["cards"]), timeout=args.probe_timeout)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=False, default=str))
    else:
        print(report_text(report))
    failed = bool(report["quirks"]["errors"]) or (args.probe and report["probe"]["status"] == "failed")
    return 1 if failed else 0


# --- collecting ---------------------------------------------------------------------------------


def _ray_plan(asked: str) -> dict[str, Any]:
    """{'plan': '4 x RTXPro6000 as 2 nodes x 2: <ip>, <ip>'} for --ray-plan GPU:N, or {'error': why not}."""
    gpu, _, count = asked.rpartition(":")
    if not gpu or not count.isdigit() or int(count) < 1:
        return {"error": f"--ray-plan {asked!r}; expected GPU:N, e.g. --ray-plan RTXPro6000:4 (or any:4)."}
    from levers9.launch.ray import backend as ray_backend  # imports Ray: only when asked for

    try:
        return {"plan": ray_backend.plan_text(gpu, int(count))}
    except Levers9Error as exc:
        return {"error": str(exc)}


def _slurm(gpu_count: int | None, partition: str | None) -> dict[str, Any]:
    """{'report': nodes, cards free and the plan (slurm_nodes.report)}, or {'error': why not}."""
    from levers9.launch.slurm import nodes as slurm_nodes  # the job layer loads only when --slurm asks for it

    try:
        return {"report": slurm_nodes.report(gpu_count, partition)}
    except (Levers9Error, OSError, subprocess.TimeoutExpired) as exc:
        return {"error": str(exc)}


def collect(nprocs: int | None = None) -> dict[str, Any]:
    """Everything doctor reports, as JSON-ready data."""
    report: dict[str, Any] = {"launch": _launch(), "torch": _torch()}
    # Doctor asks NVML even where the fast path would not (no driver device files): it is a diagnosis.
    with contextlib.suppress(Exception):
        import pynvml  # noqa: F401
    inv = _cards.inventory(refresh=True)
    report["cards"] = inv.to_dict()
    info = _nccl.nccl_info()
    report["nccl"] = {**dataclasses.asdict(info), "text": info.describe()}
    report["platform"] = dataclasses.asdict(read_platform())
    report["env"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith(_REPORTED_ENV_PREFIXES)}
    launch = report["launch"]
    launched_lws = launch.get("local_world_size") if launch.get("launcher") != "single" else None
    lws = nprocs or launched_lws or max(1, len(inv.cards))
    backend = "nccl" if inv.cards or report["platform"]["rocm"] else "gloo"
    plan = _quirks.plan_quirks(local_world_size=lws, backend=backend, inventory=inv, nccl=info)
    report["quirks"] = {
        "local_world_size": lws,
        "backend": backend,
        "set_env": plan.set_env,
        "errors": plan.errors,
        "warnings": plan.warnings,
        "rows": [
            {"id": o.quirk.id, "action": o.quirk.action, "status": o.status, "detail": o.detail,
             "sets": dict(o.set_env), "kept": dict(o.kept), "message": o.message,
             "evidence": list(o.quirk.evidence)}
            for o in plan.outcomes
        ],
    }  # fmt: skip
    return report


def _launch() -> dict[str, Any]:
    try:
        info = detect.launch_info()
        out: dict[str, Any] = dataclasses.asdict(info)
        out["rank"], out["world_size"] = detect.rank(), detect.world_size()
        return out
    except Exception as exc:  # a partial launcher environment is worth reporting, not crashing on
        return {"launcher": "unknown", "error": f"{type(exc).__name__}: {exc}"}


def _torch() -> dict[str, Any]:
    """torch's versions without initialising CUDA (importing torch loads its NCCL, which we then read)."""
    try:
        import torch
    except Exception as exc:
        return {"version": None, "error": f"torch cannot be imported: {exc}"}
    compiled_nccl = None
    with contextlib.suppress(Exception):
        compiled_nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
    return {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "nccl_compiled": compiled_nccl,
        "cuda_initialised": bool(torch.cuda.is_initialized()),
    }


# --- probing ------------------------------------------------------------------------------------


def probe(ncards: int, *, timeout: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
    """all_reduce across `ncards` ranks in a child process, retrying with fixes; which setting worked."""
    if ncards == 0:
        summary = "No NVIDIA cards are visible: nothing to probe."
        return {"status": "nothing to probe", "attempts": [], "summary": summary}
    attempts = []
    for label, extra in PROBE_ATTEMPTS:
        attempt = _probe_once(ncards, extra, timeout)
        attempt["setting"] = label
        attempts.append(attempt)
        if attempt["ok"] or "QuirkError" in attempt.get("output", ""):
            break  # success, or a quirk error no setting fixes
    ok = attempts[-1]["ok"]
    first = attempts[0]
    if first["ok"]:
        summary = f"all_reduce across {ncards} card(s) worked as levers9 runs it ({first['seconds']:.1f} s)."
    elif ok:
        fix = attempts[-1]["setting"]
        summary = (
            f"all_reduce across {ncards} card(s) {first['outcome']} as levers9 runs it, and worked with {fix}. "
            f"Fix: export {fix} (or put it in the job's env=)."
        )
    else:
        summary = (
            f"all_reduce across {ncards} card(s) failed with every setting tried; see each attempt's output."
        )
    return {"status": "ok" if ok else "failed", "attempts": attempts, "summary": summary}


def _probe_once(ncards: int, extra: dict[str, str], timeout: float) -> dict[str, Any]:
    env = dict(os.environ, **extra)
    env["LEVERS9_PG_TIMEOUT"] = str(max(5.0, timeout - 10))  # NCCL's own watchdog fires before we kill
    code = f"from levers9.cli.doctor import _probe_child; _probe_child({ncards}, {max(1.0, timeout - 5)!r})"
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its ranks and anything they start die with its process group
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        outcome = "worked" if proc.returncode == 0 else f"failed (exit code {proc.returncode})"
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        outcome = f"hung (no result after {timeout:g} s)"
    seconds = time.monotonic() - start
    marked = [line for line in output.splitlines() if line.startswith("LEVERS9_PROBE_RESULT ")]
    result = json.loads(marked[-1].split(" ", 1)[1]) if marked else None
    ok = proc.returncode == 0 and bool(result and result.get("ok"))
    if proc.returncode == 0 and not ok:
        outcome = f"gave wrong results ({result})"
    return {"ok": ok, "outcome": outcome, "seconds": seconds, "result": result, "output": output[-4000:]}


def _probe_child(ncards: int, timeout: float) -> None:
    """In the child: one rank per card through distributed.run; prints rank 0's verdict."""
    result = dist.run(_probe_rank, nprocs=ncards, backend="nccl", timeout=timeout)
    print("LEVERS9_PROBE_RESULT " + json.dumps(result), flush=True)


def _probe_rank() -> dict[str, Any]:
    """In each rank: all_reduce a 4 MiB tensor of (rank+1) and check every element of the sum."""
    import torch
    import torch.distributed as td

    n = dist.world_size()
    x = torch.full((1 << 20,), float(dist.rank() + 1), device=dist.device())
    start = time.monotonic()
    td.all_reduce(x)
    torch.cuda.synchronize()
    expected = n * (n + 1) / 2
    return {
        "ok": bool((x == expected).all().item()),
        "expected": expected,
        "got": float(x[0].item()),
        "all_reduce_s": time.monotonic() - start,
        "world_size": n,
        "env": {k: os.environ[k] for k in sorted(os.environ) if k.startswith("NCCL_")},
    }


# --- rendering ----------------------------------------------------------------------------------


def report_text(r: dict[str, Any]) -> str:
    """The report as readable text."""
    out: list[str] = []
    launch = r["launch"]
    out.append("Launcher")
    if "error" in launch:
        out.append(f"  {launch['error']}")
    else:
        out.append(
            f"  {launch['launcher']}: rank {launch['rank']} of {launch['world_size']}, "
            f"local rank {launch['local_rank']} of {launch['local_world_size']}, node {launch['node_rank']}"
        )
    t = r["torch"]
    out.append("torch")
    if t.get("version"):
        build = f"CUDA {t['cuda']}" if t["cuda"] else (f"ROCm {t['hip']}" if t["hip"] else "CPU only")
        out.append(f"  {t['version']} ({build}; NCCL headers {t['nccl_compiled'] or 'none'})")
    else:
        out.append(f"  {t.get('error')}")
    if "ray_plan" in r:
        out.append("Ray plan")
        out.extend(f"  {line}" for line in r["ray_plan"].get("plan", r["ray_plan"].get("error", "")).splitlines())
    if "slurm" in r:
        out.append("SLURM")
        out.extend(r["slurm"].get("report", f"  {r['slurm'].get('error', '')}").splitlines())
    inv = r["cards"]
    out.append("Cards")
    if not inv["cards"]:
        out.append(f"  No NVIDIA cards visible to this process ({inv['error'] or 'none found'}).")
    else:
        out.append(f"  driver {inv['driver_version']}, CUDA driver API {inv['cuda_driver_version']}")
        for c in inv["cards"]:
            cc = ".".join(map(str, c["compute_capability"] or ())) or "unknown"
            procs = f", processes {', '.join(map(str, c['processes']))}" if c["processes"] else ""
            out.append(
                f"  {c['index']}: {c['name']} [{c['type_name']}] cc {cc}, {c['memory_total_mib']} MiB, "
                f"{c['pci_bus_id']} (NVML {c['nvml_index']}){procs}"
            )
        if len(inv["cards"]) > 1:
            out.append("  P2P (driver-reported read) / NVLink between cards:")
            n = len(inv["cards"])
            out.append("       " + "".join(f"{j:>10}" for j in range(n)))
            for i in range(n):
                keys = [f"{i},{j}" for j in range(n)]
                cells = [f"{inv['p2p'].get(k, '?')}/{'NVL' if inv['nvlink'].get(k) else '-'}" for k in keys]
                cells[i] = "X"
                out.append(f"    {i:>3}" + "".join(f"{c:>10}" for c in cells))
    out.append("NCCL")
    nc = r["nccl"]
    out.append(f"  {nc['text']} [source: {nc['source'] or 'none'}]")
    p = r["platform"]
    out.append("Platform")
    named = (("WSL2", p["wsl"]), (f"ROCm {p['rocm']}", p["rocm"]), ("Docker", p["docker"]))
    flags = [name for name, on in named if on]
    shm = "none" if p["shm_bytes"] is None else size_text(p["shm_bytes"])
    out.append(f"  /dev/shm {shm}; {', '.join(flags) or 'native Linux'}")
    if r["env"]:
        out.append("  set: " + " ".join(f"{k}={v}" for k, v in r["env"].items()))
    q = r["quirks"]
    out.append(f"Quirks (planned for {q['local_world_size']} rank(s) on this node, backend {q['backend']})")
    for row in q["rows"]:
        mark = {"applies": "*", "does not apply": "-", "unknown": "?", "disabled": "x"}[row["status"]]
        out.append(f"  {mark} {row['id']} ({row['action']}): {row['status']}: {row['detail']}")
        if row["sets"]:
            out.append(f"      sets {' '.join(f'{k}={v}' for k, v in row['sets'].items())}")
        if row["kept"]:
            out.append(f"      leaves {' '.join(f'{k}={v}' for k, v in row['kept'].items())} as you set it")
    out += [f"  ERROR {e}" for e in q["errors"]] + [f"  WARNING {w}" for w in q["warnings"]]
    if "probe" in r:
        out.append("Probe")
        pr = r["probe"]
        for a in pr["attempts"]:
            out.append(f"  {a['setting']}: {a['outcome']} ({a['seconds']:.1f} s)")
            if not a["ok"]:
                tail = [line for line in a["output"].strip().splitlines() if line.strip()][-5:]
                out.extend(f"      | {line}" for line in tail)
        out.append(f"  {pr['summary']}")
    return "\n".join(out)
