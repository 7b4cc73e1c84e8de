"""A rank or job killed by the kernel's out-of-memory killer is named as such, read from the cgroup's
OOM-kill counter (a stand-in cgroup folder here, through LEVERS9_CGROUP_DIR); a SIGKILL without a
rise in the counter is reported as a plain SIGKILL."""

from __future__ import annotations

import functools
import select
import signal
from pathlib import Path

import pytest

from levers9 import distributed as dist
from levers9.errors import JobCrashed, RankCrashed
from levers9.launch import job
from levers9.procs import oom, start
from levers9.procs.supervise import Supervisor
from levers9.procs.watch import Watcher
from tests import jobfns, rankfns

pytestmark = pytest.mark.procs

V2_EVENTS = "low 0\nhigh 0\nmax 3\noom 1\noom_kill {n}\noom_group_kill 0\n"
V1_CONTROL = "oom_kill_disable 0\nunder_oom 0\noom_kill {n}\n"
OOM_WORDS = "the out-of-memory killer fired in this cgroup"


@pytest.fixture(params=[("memory.events", V2_EVENTS), ("memory.oom_control", V1_CONTROL)], ids=["v2", "v1"])
def cgroup(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A stand-in cgroup folder whose counter file says oom_kill 0; returns the counter file."""
    name, text = request.param
    folder = tmp_path / "cgroup"
    folder.mkdir()
    (folder / name).write_text(text.format(n=0))
    monkeypatch.setenv("LEVERS9_CGROUP_DIR", str(folder))
    return folder / name


@pytest.mark.timeout(60)
def test_a_rank_the_oom_killer_took_is_named(cgroup: Path) -> None:
    with pytest.raises(RankCrashed) as info:
        dist.run(rankfns.killed_like_the_oom_killer_on_rank_1, str(cgroup), nprocs=2)
    text = str(info.value)
    assert "rank 1" in text
    assert (
        f"killed by SIGKILL; {OOM_WORDS} (count 0 → 1): reduce batch size or give the job more memory" in text
    )


@pytest.mark.timeout(60)
def test_a_rank_killed_without_the_oom_killer_is_a_plain_sigkill(cgroup: Path) -> None:
    with pytest.raises(RankCrashed) as info:
        dist.run(rankfns.killed_like_the_oom_killer_on_rank_1, None, nprocs=2)
    assert "killed by SIGKILL" in str(info.value) and "out-of-memory" not in str(info.value)


@pytest.mark.timeout(60)
def test_a_job_the_oom_killer_took_is_named(cgroup: Path) -> None:
    crash = job(stream_output=False)(jobfns.killed_like_the_oom_killer)
    with pytest.raises(JobCrashed) as info:
        crash.remote(str(cgroup))
    text = str(info.value)
    assert f"was killed by SIGKILL; {OOM_WORDS} (count 0 → 1)" in text and "allocating" in text


@pytest.mark.timeout(60)
def test_the_count_before_is_read_before_the_child_starts(cgroup: Path) -> None:
    """Seen with a second suite beside this one on 2 cores: a job killed at once was dead before its supervisor
    read the cgroup's count, so the count it started from already held its own kill, and it was called a plain
    SIGKILL. Here the child is dead before the supervisor exists."""
    watcher = Watcher(lambda child, stream, line: None)
    try:
        child = watcher.add(start.start(functools.partial(jobfns.killed_like_the_oom_killer, str(cgroup)),
                                        method=start.StartMethod("fork")))  # fmt: skip
        assert child.pidfd is not None
        assert select.select([child.pidfd], [], [], 30)[0], "the child did not end within 30 s"
        assert child.poll() and child.signal == signal.SIGKILL
        outcome = Supervisor(watcher, [child], timeout=None, grace=1.0).run()[0]
    finally:
        watcher.close()
    assert outcome.oom_counts == (0, 1)
    assert OOM_WORDS in oom.killed_by(signal.SIGKILL, *outcome.oom_counts)


@pytest.mark.timeout(60)
def test_a_job_killed_without_the_oom_killer_is_a_plain_sigkill(cgroup: Path) -> None:
    crash = job(stream_output=False)(jobfns.killed_like_the_oom_killer)
    with pytest.raises(JobCrashed) as info:
        crash.remote(None)
    assert "was killed by SIGKILL before returning" in str(info.value)
    assert "out-of-memory" not in str(info.value)


@pytest.mark.fast
def test_the_cgroup_is_found_through_proc_and_the_mount_table() -> None:
    v1 = oom.cgroup_dirs(
        "5:devices:/\n4:memory:/process_api/abc\n0::/\n",
        "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
        "36 31 0:33 / /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices\n",
    )
    assert v1 == [Path("/sys/fs/cgroup/memory/process_api/abc")]
    v2 = oom.cgroup_dirs(
        "0::/user.slice/user-1000.slice/session-3.scope\n",
        "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n",
    )
    assert v2 == [Path("/sys/fs/cgroup/user.slice/user-1000.slice/session-3.scope")]
    # a container whose cgroup mount is rooted at its own cgroup
    nested = oom.cgroup_dirs(
        "0::/kubepods/pod1/c1\n", "30 23 0:26 /kubepods/pod1/c1 /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
    )
    assert nested == [Path("/sys/fs/cgroup")]


@pytest.mark.fast
def test_without_a_readable_counter_no_oom_claim_is_made(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("LEVERS9_CGROUP_DIR", str(tmp_path / "missing"))
    assert oom.oom_kills() is None
    assert "fired in this cgroup" not in oom.killed_by(9, None, None)
    assert oom.killed_by(15, 0, 1) == "killed by SIGTERM"
