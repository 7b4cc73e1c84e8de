"""Workspace settings: defaults, atomic writes, corrupt files, and `levers9 workspace` end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from levers9.errors import SettingsError
from levers9.launch.settings import load_settings, settings_path, update_settings

pytestmark = pytest.mark.fast


def levers9(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "levers9", *args],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=60,
    )


def test_defaults_without_a_file_and_nothing_written_on_read() -> None:
    settings = load_settings()
    assert (settings.multi_gpu, settings.max_gpu_count, settings.exists) == (False, 8, False)
    assert not settings_path().exists()


def test_settings_path_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("LEVERS9_CONFIG_DIR")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert settings_path() == tmp_path / "xdg" / "levers9" / "workspace.toml"


def test_round_trip_is_atomic_and_leaves_no_temporary_files() -> None:
    before, after = update_settings(multi_gpu=True, max_gpu_count=4)
    assert (before.multi_gpu, after.multi_gpu, after.max_gpu_count) == (False, True, 4)
    reread = load_settings()
    assert (reread.multi_gpu, reread.max_gpu_count, reread.exists) == (True, 4, True)
    assert sorted(p.name for p in settings_path().parent.iterdir()) == [
        "workspace.toml",
        "workspace.toml.lock",
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[workspace\nmulti_gpu = true\n", "is not valid TOML"),
        ("[workspace]\nmulti_gpu = 'yes'\n", "workspace.multi_gpu must be true or false, got 'yes'"),
        (
            "[limits]\nmax_gpu_count = '8'\n",
            "limits.max_gpu_count must be an integer from 1 to 1024, got '8'",
        ),
        ("[limits]\nmax_gpu_count = 0\n", "limits.max_gpu_count must be an integer"),
    ],
)
def test_a_corrupt_file_is_an_error_naming_it(text: str, message: str) -> None:
    settings_path().write_text(text)
    with pytest.raises(SettingsError, match=message) as info:
        load_settings()
    assert str(settings_path()) in str(info.value)


@pytest.mark.procs
def test_cli_multi_gpu_switch_end_to_end() -> None:
    shown = levers9("workspace")
    assert shown.returncode == 0, shown.stderr
    assert "multi-GPU jobs:  off" in shown.stdout and "max GPU count:   8" in shown.stdout
    assert levers9("workspace", "multi-gpu").stdout.startswith("Multi-GPU jobs: off")
    turned = levers9("workspace", "multi-gpu", "on")
    assert (
        turned.returncode == 0
        and "Multi-GPU jobs: on (was off). Takes effect on the next call." in turned.stdout
    )
    assert load_settings().multi_gpu is True
    assert levers9("workspace", "multi-gpu").stdout.startswith("Multi-GPU jobs: on")
    assert levers9("workspace", "multi-gpu", "off").returncode == 0
    assert load_settings().multi_gpu is False


USERS_FILE = """\
# our lab's notes: cards 4-7 belong to the vision team
version = 1

[workspace]
multi_gpu = false   # keep off until the new PSU is in
team = "vision"     # read by our own tooling, not by levers9

[limits]
max_gpu_count = 4
"""


@pytest.mark.procs
def test_cli_multi_gpu_on_keeps_the_users_comments_and_unknown_keys() -> None:
    settings_path().parent.mkdir(parents=True, exist_ok=True)
    settings_path().write_text(USERS_FILE)
    turned = levers9("workspace", "multi-gpu", "on")
    assert turned.returncode == 0, turned.stderr
    text = settings_path().read_text()
    assert text == USERS_FILE.replace("multi_gpu = false", "multi_gpu = true"), text
    reread = load_settings()
    assert (reread.multi_gpu, reread.max_gpu_count) == (True, 4)


def test_a_new_file_explains_itself_and_a_default_left_unmentioned_stays_so() -> None:
    update_settings(max_gpu_count=2)
    text = settings_path().read_text()
    assert "# levers9 workspace settings." in text and "max_gpu_count = 2" in text and "multi_gpu = false" in text
    settings_path().write_text("[limits]\nmax_gpu_count = 3\n")
    update_settings(max_gpu_count=5)
    assert settings_path().read_text() == "[limits]\nmax_gpu_count = 5\n"


@pytest.mark.procs
def test_cli_max_gpu_count_end_to_end() -> None:
    changed = levers9("workspace", "max-gpu-count", "4")
    assert changed.returncode == 0 and "Max GPU count per job: 4 (was 8)" in changed.stdout
    assert load_settings().max_gpu_count == 4
    bad = levers9("workspace", "max-gpu-count", "0")
    assert bad.returncode == 2 and "expected 1 to 1024 cards, got 0" in bad.stderr
    not_a_number = levers9("workspace", "max-gpu-count", "four")
    assert not_a_number.returncode == 2 and "expected 1 to 1024 cards, got four" in not_a_number.stderr
    shown = json.loads(levers9("workspace", "show", "--json").stdout)
    assert shown["max_gpu_count"] == 4 and shown["multi_gpu"] is False


@pytest.mark.procs
def test_cli_reports_a_corrupt_file() -> None:
    settings_path().write_text("not toml [")
    result = levers9("workspace", "multi-gpu", "on")
    assert result.returncode == 1 and str(settings_path()) in result.stderr
    assert settings_path().read_text() == "not toml ["  # not silently overwritten
