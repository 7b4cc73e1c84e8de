"""This suite's tier hook (tests/conftest.py) on small suites run by pytest: with `-n N --dist loadgroup`, tests
marked `ray` get their group from it (before pytest-xdist reads groups) and the scheduler runs that group alone on
one worker; a test's own tier replaces its module's for `-m`; a test with no tier, or two, fails the collection."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.procs

REPO = Path(__file__).resolve().parents[1]

SUITE = '''
import os
import pytest

pytestmark = pytest.mark.procs

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


TIERED = '''
import pytest

pytestmark = pytest.mark.procs

def test_starts_a_process():
    pass

@pytest.mark.fast
def test_pure():
    pass

@pytest.mark.parametrize("backend", ["local", pytest.param("ray", marks=pytest.mark.ray)])
def test_on(backend):
    pass
'''


def _pytest(tmp_path: Path, suite: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Collect `suite` as test_small.py with this suite's tier hook; pytest's answer."""
    (tmp_path / "test_small.py").write_text(suite)
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_collection_modifyitems  # noqa: F401\n")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", "--rootdir", str(tmp_path),
         "-c", os.devnull, *args, str(tmp_path / "test_small.py")],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("tier", "selected"), [
    ("fast", ["test_pure"]),
    ("procs", ["test_starts_a_process", "test_on[local]"]),
    ("ray", ["test_on[ray]"]),
])  # fmt: skip
def test_a_tests_own_tier_replaces_its_modules(tmp_path: Path, tier: str, selected: list[str]) -> None:
    done = _pytest(tmp_path, TIERED, "-m", tier)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(line.split("::")[1] for line in done.stdout.splitlines() if "::" in line) == sorted(selected)


@pytest.mark.timeout(60)
def test_a_test_with_no_tier_or_two_fails_the_collection(tmp_path: Path) -> None:
    suite = "import pytest\n\ndef test_none():\n    pass\n\n@pytest.mark.fast\n@pytest.mark.procs\ndef test_two():\n    pass\n"
    done = _pytest(tmp_path, suite)
    assert done.returncode != 0
    assert "test_small.py::test_none: no tier" in done.stderr and "test_small.py::test_two: tiers procs, fast" in done.stderr
    assert "pytestmark = pytest.mark.procs" in done.stderr
