"""The prepared GPU check script runs end to end here as a dry run (2 gloo ranks), so it is ready for a GPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.proc_util import children_of, left_behind

pytestmark = pytest.mark.procs

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_passes_every_check_it_can_run(tmp_path: Path) -> None:
    before = set(children_of(os.getpid()))
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "compat_tests" / "gpu_check.py"), "--json-out", str(report)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "no CUDA: a dry run" in done.stdout
    statuses = {r["check"]: r["status"] for r in json.loads(report.read_text())["results"]}
    assert statuses == {"doctor": "PASS", "run": "PASS", "stall": "PASS", "fresh": "PASS", "in_place": "PASS", "probe": "SKIP"}
    assert left_behind(before) == []
