"""One set of ranks (levers9/distributed/rank_set.py): one function for a rank's variables, one rule for their
output, and the one Supervisor watching another node's share beside this node's ranks, on real processes."""

from __future__ import annotations

import dataclasses
import functools
import signal
import time
from collections.abc import Iterator

import pytest

from levers9.distributed.rank_set import RankOutput, rank_vars
from levers9.errors import FailureKind
from levers9.procs import failure, lines, start
from levers9.procs.outcome import StopReason, kind_of, root_cause
from levers9.procs.supervise import Supervisor
from levers9.procs.watch import Child, Ended, Watcher

pytestmark = pytest.mark.procs


@pytest.mark.fast
def test_one_function_gives_a_rank_its_variables_on_one_node_or_on_node_i_of_k() -> None:
    one = rank_vars(1, 2, 5000)
    assert [one[k] for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "GROUP_WORLD_SIZE")] == [
        "1", "1", "2", "0", "0", "1"]  # fmt: skip
    assert one["MASTER_ADDR"] == "127.0.0.1" and one["MASTER_PORT"] == one["LEVERS9_STORE_PORT"] == "5000"
    assert one["TORCHELASTIC_RUN_ID"].startswith("levers9-") and one["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    across = rank_vars(3, 4, 5000, addr="10.0.0.1", run_id="run-7", shares=(2, 2), node=1)
    assert [across[k] for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "GROUP_WORLD_SIZE",
                                "WORLD_SIZE")] == ["3", "1", "2", "1", "1", "2", "4"]  # fmt: skip
    assert across["MASTER_ADDR"] == "10.0.0.1" and across["TORCHELASTIC_RUN_ID"] == "run-7"
    assert "LEVERS9_STORE_PORT" not in across  # that one means a loopback store
    assert set(one) - {"LEVERS9_STORE_PORT"} == set(across)


@pytest.mark.fast
def test_pieces_of_several_ranks_lines_reach_the_caller_each_line_labelled_once() -> None:
    written: list[str] = []
    out = RankOutput(True, lambda stream, text: written.append(f"{stream}:{text}"))
    out(1, "stdout", "a long line, ")  # a piece: the line goes on
    out(1, "stdout", "in pieces\n")
    out(0, "stdout", "rank 0 is not labelled\n")
    out(2, "stdout", "unfinished")
    out(3, "stdout", "rank 3 ends rank 2's line first\n")
    out(1, "stderr", "10%\r20%\r")
    out(1, "stderr", "30%\n")
    assert "".join(w.split(":", 1)[1] for w in written if w.startswith("stdout:")) == (
        "[rank 1] a long line, in pieces\nrank 0 is not labelled\n[rank 2] unfinished\n[rank 3] rank 3 ends rank 2's line first\n"
    )
    assert "".join(w.split(":", 1)[1] for w in written if w.startswith("stderr:")) == "[rank 1] 10%\r[rank 1] 20%\r[rank 1] 30%\n"


@pytest.mark.fast
def test_a_redraw_is_handed_on_after_hold_s_and_a_plain_unfinished_line_waits_for_its_end() -> None:
    """What a pipe's cutter does (output that is not a terminal's): a "\\r" redraw is not held until its line ends
    (a progress bar then moved only at 100%), and a line written in pieces without one is still never split."""
    cutter = lines.LineCutter(exact=True)
    assert cutter.feed(b"epoch 1: ") == [] and not cutter.holding
    assert cutter.due(time.monotonic() + 60) == []  # a plain unfinished line waits for its newline
    assert cutter.feed(b"\r 10%|#") == [] and cutter.holding
    assert cutter.due(time.monotonic()) == []  # a burst of quick writes stays one piece
    assert cutter.due(time.monotonic() + lines.HOLD_S) == ["epoch 1: \r 10%|#"]
    assert not cutter.holding
    assert cutter.feed(b"\r 20%|##") == [] and cutter.due(time.monotonic() + lines.HOLD_S) == ["\r 20%|##"]
    assert cutter.feed(b"\r100%|###\nnext") == ["\r100%|###\n"] and not cutter.holding
    assert cutter.end() == ["next\n"]


class OtherNode(Ended):
    """Another node's share as the supervisor sees it (nodes.NodeShare reads it from the control store): ends
    when the test says how."""

    result: bytes | None = None
    oom_before: int | None = None

    def __init__(self) -> None:
        self.pid, self.reported, self.ended_at, self.polls = 0, False, None, 0

    def poll(self) -> bool:
        self.polls += 1
        return self.status is not None


@pytest.fixture
def one_rank() -> Iterator[tuple[Watcher, Child]]:
    """A real child that sleeps, on a watcher; stopped and closed afterwards whatever happened."""
    watcher = Watcher(lambda child, stream, line: None)
    method = start.choose()
    target = functools.partial(time.sleep, 120)
    try:
        yield watcher, watcher.add(start.start(target, method=method, shipped=None if method.forks else failure.ship(target)))
    finally:
        watcher.stop(0)
        watcher.close()


@pytest.mark.timeout(60)
def test_a_lost_node_stops_this_nodes_ranks_and_is_the_root_cause(one_rank: tuple[Watcher, Child]) -> None:
    watcher, rank = one_rank
    other = OtherNode()
    supervisor = Supervisor(watcher, [rank, other], timeout=None, grace=5.0, stop_on_failure=True)
    assert not supervisor.step(0.05) and other.polls == 1  # polled beside a rank that still runs
    other.lost, other.status, other.ended_at = True, (None, None), time.monotonic()  # its heartbeat stopped
    outcomes = supervisor.run()
    assert supervisor.stopped_for is StopReason.SIBLING
    assert outcomes[0].stopped_for is StopReason.SIBLING and outcomes[0].signal == signal.SIGTERM
    assert outcomes[1].lost and outcomes[1].stopped_for is None
    assert root_cause(outcomes) is outcomes[1] and kind_of(outcomes[1]) is FailureKind.LOST


@pytest.mark.timeout(60)
def test_a_peer_loss_error_waits_for_the_peers_own_failure_which_is_the_root_cause(one_rank: tuple[Watcher, Child]) -> None:
    """Across nodes, a rank that only says it lost a peer waits `peer_loss_window` for the failure that caused it
    (a heartbeat may take seconds); a failure of its own stops the rest after `window`, and is the root cause."""
    watcher, rank = one_rank
    other = OtherNode()
    supervisor = Supervisor(watcher, [rank, other], timeout=None, grace=5.0, stop_on_failure=True, window=0.05,
                            peer_loss_window=600)  # fmt: skip
    lost_peer = dataclasses.replace(failure.capture(RuntimeError("Connection closed by peer")), peer_loss=True)
    other.failure, other.status, other.ended_at, other.reported = lost_peer, (1, None), time.monotonic(), True
    for _ in range(10):  # ten steps, each longer than `window`: not stopped for a lost peer alone
        assert not supervisor.step(0.06)
    rank.signal_tree(signal.SIGKILL)  # a failure of its own, later in time
    outcomes = supervisor.run()
    assert outcomes[0].signal == signal.SIGKILL and outcomes[0].stopped_for is None
    assert root_cause(outcomes) is outcomes[0]  # before the peer-loss error that came first
