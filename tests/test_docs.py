"""The documentation's runnable examples run: every ```python block after a `<!-- run -->` line in
docs/*.md (and README.md) is run as a script in a fresh interpreter, on 4 simulated cards, and must exit 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import strip_launcher_env

pytestmark = pytest.mark.procs

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
# A `<!-- run -->` line, optional blank lines, then a fenced python block (captured up to its closing fence).
RUNNABLE = re.compile(r"^<!-- run -->\n(?:[ \t]*\n)*```python\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def runnable_blocks() -> list[tuple[str, str]]:
    """(page:line, code) for every block marked runnable."""
    blocks = []
    for page in PAGES:
        text = page.read_text()
        for match in RUNNABLE.finditer(text):
            line = text.count("\n", 0, match.start(1)) + 1
            blocks.append((f"{page.relative_to(ROOT)}:{line}", match.group(1)))
    return blocks


BLOCKS = runnable_blocks()


def test_the_docs_have_runnable_examples_and_every_marker_is_followed_by_a_python_block() -> None:
    markers = sum(page.read_text().count("<!-- run -->") for page in PAGES)
    assert len(BLOCKS) >= 8, f"expected the docs to keep their runnable examples, found {len(BLOCKS)}"
    assert markers == len(BLOCKS), "a `<!-- run -->` marker is not followed by a ```python block"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("where", "code"), BLOCKS, ids=[where for where, _ in BLOCKS])
def test_a_runnable_example_runs(where: str, code: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(code)
    env = dict(os.environ)
    strip_launcher_env(env)
    config = tmp_path / "config"
    config.mkdir()
    (config / "workspace.toml").write_text("[workspace]\nmulti_gpu = true\n")  # examples may use gpu_count > 1
    env.update(
        LEVERS9_SIMULATE_GPUS="RTXPro6000:4",
        LEVERS9_CONFIG_DIR=str(config),
        LEVERS9_STATE_DIR=str(tmp_path / "state"),
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
    )
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, f"{where} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    assert done.stdout.strip(), f"{where} printed nothing; every runnable example shows its result"
