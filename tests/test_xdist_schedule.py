"""`pytest -n N --dist loadgroup` with this suite's conftest: tests marked `ray` get their group from the tier
hook (before pytest-xdist reads groups), and the scheduler runs that group alone on one worker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SUITE = '''
import os
import pytest

def _note(name):
    with open(os.path.join(os.environ["NOTES"], name), "w") as f:
        f.write(os.environ.get("PYTEST_XDIST_WORKER", "main"))

@pytest.mark.ray
@pytest.mark.parametrize("i", range(3))
def test_on_ray(i):
    _note(f"ray-{i}")

@pytest.mark.parametrize("i", range(8))
def test_other(i):
    _note(f"other-{i}")
'''


def _run_on_three_workers(tmp_path: Path) -> dict[str, str]:
    """Run the small suite above on three workers, with this suite's two hooks; which worker ran each test."""
    (tmp_path / "test_small.py").write_text(SUITE)
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_collection_modifyitems, pytest_xdist_make_scheduler  # noqa: F401\n")
    notes = tmp_path / "notes"
    notes.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "NOTES": str(notes)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "3", "--dist", "loadgroup",
         "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_small.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return {note.name: note.read_text() for note in notes.iterdir()}


@pytest.mark.timeout(150)
def test_the_ray_group_runs_alone_on_one_worker(tmp_path: Path) -> None:
    ran_on = _run_on_three_workers(tmp_path)
    assert len(ran_on) == 11
    ray_workers = {ran_on[f"ray-{i}"] for i in range(3)}
    assert len(ray_workers) == 1, ran_on
    assert not ray_workers & {ran_on[f"other-{i}"] for i in range(8)}, ran_on  # nothing else on its worker
