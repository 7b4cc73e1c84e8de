"""The checks that need real cards, as one script for a GPU machine (about 2 minutes; CI never runs it).

    python compat_tests/gpu_check.py [--json-out report.json]

On a machine with CUDA it runs, in order:
  doctor        `levers9 doctor --json`: the cards, the NCCL loaded, the quirk rows that apply
  run           `distributed.run` over every card (forked ranks, NCCL): device(), all_reduce_mean,
                a DDP step through wrap(), torch's flight recorder counting NCCL collectives, and a
                collective left enqueued behind a spin kernel seen as "issued, not completed"
  stall         (2+ cards) rank 1 sleeps before an all_reduce that rank 0 enqueued and waits for in
                `.item()`: a StallError naming both ranks and their lines
  fresh         the same run after CUDA is initialised in the caller (ranks are fresh interpreters)
  in_place      a world of one in this process: device() is cuda:0, all_reduce_mean returns its input
  probe         `levers9 doctor --probe`
Without CUDA it runs the same flow on 2 gloo ranks (a dry run of the script itself) and says so.
Each check prints `CHECK <name>: PASS|FAIL|SKIP <detail>`; the exit status is 1 if any failed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from levers9 import distributed as dist
from levers9.distributed.stalls import board
from levers9.errors import StallError

SPIN_CYCLES = 3_000_000_000  # about a second and a half of torch.cuda._sleep on current cards
# how long the recorder may take to count a finished collective completed (a hang guard): gloo's worker thread
# counts it after the work's callbacks ran, late on a loaded machine (over 5 s once, on 2 busy cores)
SETTLE_S = 60.0


def wait_for(predicate: Callable[[], bool], seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def on_every_rank(cfg: dict[str, Any]) -> dict[str, Any]:
    """Helpers, a DDP step, and the flight recorder's view of this rank's collectives."""
    device = dist.device()
    mean = dist.all_reduce_mean(torch.tensor([float(dist.rank())], device=device)).item()
    model = dist.wrap(torch.nn.Linear(8, 1).to(device))
    model(torch.ones(4, 8, device=device)).sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    settled = wait_for(lambda: (s := board.read_status()) is not None and not s.waiting, SETTLE_S)
    after_step = board.read_status()
    pending_seen = None
    if device.type == "cuda":
        torch.cuda._sleep(SPIN_CYCLES)  # the all_reduce below queues behind this kernel
        torch.distributed.all_reduce(torch.ones(1, device=device))  # returns once enqueued
        pending_seen = wait_for(lambda: (s := board.read_status()) is not None and s.waiting, 1.0)
        pending_name = board.name_pending(board.read_status())  # type: ignore[arg-type]
        torch.cuda.synchronize()
        cleared = wait_for(lambda: (s := board.read_status()) is not None and not s.waiting, SETTLE_S)
    else:
        pending_name, cleared = "", True
    import pickle

    raw = {label: pickle.loads(dump(False, False, False)).get("pg_status") for label, dump in board._dumpers()}
    return {
        "recorder_raw_pg_status": raw,  # to see by eye that the two recorders do not count the same groups twice
        "rank": dist.rank(),
        "world_size": dist.world_size(),
        "device": str(device),
        "backend": torch.distributed.get_backend(),
        "mean_rank": mean,
        "recorder_after_step": None if after_step is None else [after_step.issued, after_step.completed],
        "recorder_settled": settled,
        "pending_seen_behind_spin_kernel": pending_seen,
        "pending_name": pending_name,
        "pending_cleared_after_synchronize": cleared,
    }


def stall_on_cards(cfg: Any) -> None:
    """Rank 0 enqueues an all_reduce and blocks in .item(); rank 1 sleeps and never issues it."""
    x = torch.ones(1, device=dist.device())
    if dist.rank() == 1:
        time.sleep(120)  # GPU-CHECK-SLEEP
    torch.distributed.all_reduce(x)  # GPU-CHECK-ALL-REDUCE
    x.item()  # GPU-CHECK-ITEM


def line_of(marker: str) -> int:
    source = open(__file__).read().splitlines()
    return next(i for i, line in enumerate(source, 1) if marker in line and "line_of(" not in line)


def check_doctor() -> str:
    done = subprocess.run([sys.executable, "-m", "levers9", "doctor", "--json"], capture_output=True, text=True, timeout=120)
    report = json.loads(done.stdout)
    quirks = report["quirks"]
    applying = [row["id"] for row in quirks["rows"] if row["status"] != "does not apply"]
    names = [card.get("name") for card in report["cards"]["cards"]]
    return (
        f"exit {done.returncode}; cards {names}; {report['nccl']['text']}; quirk rows applying {applying}; "
        f"would set {quirks['set_env']}; errors {quirks['errors']}"
    )


def check_run(nprocs: int) -> str:
    result = dist.run(on_every_rank, {}, nprocs=nprocs, timeout=180)
    expected_mean = (nprocs - 1) / 2
    assert abs(result["mean_rank"] - expected_mean) < 1e-6, f"mean of ranks {result['mean_rank']}, expected {expected_mean}"
    assert result["world_size"] == nprocs, result
    assert result["recorder_after_step"] is not None and result["recorder_settled"], f"recorder: {result}"
    if result["device"].startswith("cuda"):
        assert result["backend"] == "nccl", result
        assert result["pending_seen_behind_spin_kernel"], f"the enqueued all_reduce was never seen as pending: {result}"
        assert result["pending_name"].startswith("nccl:all_reduce"), result
        assert result["pending_cleared_after_synchronize"], result
    return json.dumps(result)


def check_stall(nprocs: int) -> str:
    start = time.monotonic()
    try:
        dist.run(stall_on_cards, None, nprocs=2, stall_timeout=5, timeout=180)
    except StallError as exc:
        text = str(exc)
    else:
        raise AssertionError("the run finished; expected a StallError")
    elapsed = time.monotonic() - start
    # NCCL returns from all_reduce once it is enqueued, so rank 0 waits in .item(); gloo waits in all_reduce.
    waits_at = line_of("GPU-CHECK-ITEM") if torch.cuda.is_available() else line_of("GPU-CHECK-ALL-REDUCE")
    # On torch < 2.11 with gloo, stall_timeout= ranks are fresh interpreters, which get this script's functions by
    # value (cloudpickle names their file "<dynamic-code>").
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    where = "<dynamic-code>" if board.forked_ranks_cannot_record(backend) else __file__
    assert f"{where}:{waits_at}" in text and "rank 0: waiting" in text, text
    assert "rank 1: not in a collective" in text and f"{where}:{line_of('GPU-CHECK-SLEEP')}" in text, text
    return f"reported after {elapsed:.1f} s:\n" + text


def check_fresh(nprocs: int) -> str:
    if torch.cuda.is_available():
        torch.cuda.init()
    result = dist.run(on_every_rank, {}, nprocs=nprocs, timeout=180)
    assert result["world_size"] == nprocs, result
    return json.dumps(result)


def check_in_place() -> str:
    device = dist.device()
    value = dist.all_reduce_mean(torch.tensor([3.0], device=device)).item()
    assert value == 3.0, value
    if torch.cuda.is_available():
        assert device == torch.device("cuda", 0), device
    return f"device {device}, all_reduce_mean(3.0) = {value}"


def check_probe() -> str:
    done = subprocess.run([sys.executable, "-m", "levers9", "doctor", "--probe"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout[-1500:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json-out", help="also write the results to this file")
    args = parser.parse_args()
    cards = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nprocs = cards or 2
    print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}, cards: {cards}", flush=True)
    if not cards:
        print("no CUDA: a dry run of this script on 2 gloo ranks; nothing here says anything about cards", flush=True)
    checks: list[tuple[str, Callable[[], str] | None, str]] = [
        ("doctor", check_doctor, ""),
        ("run", lambda: check_run(nprocs), ""),
        ("stall", (lambda: check_stall(nprocs)) if nprocs >= 2 else None, "needs 2 cards: NCCL refuses two ranks on one card"),
        ("fresh", lambda: check_fresh(nprocs), ""),
        ("in_place", check_in_place, ""),
        ("probe", check_probe if cards else None, "needs cards"),
    ]
    results = []
    for name, check, why_skipped in checks:
        start = time.monotonic()
        if check is None:
            status, detail = "SKIP", why_skipped
        else:
            try:
                status, detail = "PASS", check()
            except Exception:
                status, detail = "FAIL", traceback.format_exc()
        seconds = round(time.monotonic() - start, 1)
        print(f"CHECK {name}: {status} ({seconds} s) {detail}", flush=True)
        results.append({"check": name, "status": status, "seconds": seconds, "detail": detail})
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"torch": torch.__version__, "cards": cards, "results": results}, f, indent=2)
    return 1 if any(r["status"] == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
