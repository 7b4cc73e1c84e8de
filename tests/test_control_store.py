"""The protocol between nodes (levers9/distributed/control_store.py) as a pure table, against a dict-backed store
with the torch Store methods it uses: each thing a node says lands under its documented key, reads back as the
typed value it was, and reads as "not said yet" before. No process is started, no socket opened."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from levers9.distributed.control_store import ControlStore, Report, StartRequest
from levers9.distributed.nodes import rank_failure_of
from levers9.distributed.stalls import Quiet
from levers9.errors import FailureKind
from levers9.procs.failure import FailureRecord, ship, unship

pytestmark = pytest.mark.fast


class DictStore:
    """A fake of torch.distributed.Store's set/get/check/add/delete_key over a dict (values as bytes, as torch
    keeps them); `get` of a missing key fails, as the real one would block."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str | bytes) -> None:
        self.data[key] = value.encode() if isinstance(value, str) else bytes(value)

    def get(self, key: str) -> bytes:
        if key not in self.data:
            raise AssertionError(f"get({key!r}) of a key never set: the real store would block here")
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(key in self.data for key in keys)

    def add(self, key: str, amount: int) -> int:
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value

    def delete_key(self, key: str) -> bool:
        return self.data.pop(key, None) is not None


REQUEST = StartRequest(call=b"fn", backend="gloo", env={"A": "1"}, master=("127.0.0.2", 29400), run_id="levers9-1-2",
                       attempt_env={"TORCHELASTIC_RESTART_COUNT": "0"}, make_group=True, stop_grace=5.0,
                       prefix_output=True, forks=True, diagnostics=False, stall_timeout=None)  # fmt: skip
REPORT = Report(rank=3, node=1, address="127.0.0.3", pid=42, exitcode=None, signal=9, failure=None, tail=("x",), wall=1.5)
QUIET = Quiet(seconds=2.5, waiting=True)

Call = Callable[[ControlStore], Any]

# (what a node says, the key and stored value that puts in the store, how the other side reads it, what it reads
#  before anything was said, what it reads after)
TABLE: list[tuple[str, Call, str, Any, Call, Any, Any]] = [
    ("agent 1 joins", lambda c: c.join(1, "127.0.0.3"), "ready/1", b"127.0.0.3",
     lambda c: c.joined(1), None, "127.0.0.3"),
    ("agent 1 beats", lambda c: c.beat(1), "hb/1", b"1", lambda c: c.beats(1), 0, 1),
    ("node 0 starts an attempt", lambda c: c.next_attempt(), "attempts", b"1", lambda c: c.next_attempt(), 0, 1),
    ("node 0 declares node 1 lost", lambda c: c.declare_lost(1), "lost/1", b"1", lambda c: c.is_lost(1), False, True),
    ("node 0 asks a replacement of node 1 for attempt 4", lambda c: c.ask_replacement(1, 4), "replace/1", b"4",
     lambda c: c.take_replacement(1), None, 4),
    ("node 0's task gives up on node 1", lambda c: c.refuse_replacement(1, "no node"), "noreplace/1", b"no node",
     lambda c: c.replacement_refused(1), None, "no node"),
    ("node 0's task launches node 1's agent", lambda c: c.new_generation(1), "gen/1", b"1",
     lambda c: c.generation(1), 0, 1),
    ("the job ends", lambda c: c.end(), "end", b"ok", lambda c: (c.ended(), c.ended_failed()), (False, False),
     (True, False)),
    ("the job ends as its run failed", lambda c: c.end(True), "end", b"failed", lambda c: (c.ended(), c.ended_failed()),
     (False, False), (True, True)),
    ("a launcher hosts levers9 run --nnodes", lambda c: c.open_rendezvous(("job7", 2, 3)), "rendezvous", ("job7", 2, 3),
     lambda c: c.rendezvous(), None, ("job7", 2, 3)),
    ("a launcher joins by c10d", lambda c: c.next_node(), "rendezvous/joined", b"1", lambda c: c.next_node(), 1, 2),
    ("node 0 starts attempt 2", lambda c: c.post_start(2, REQUEST), "a2/start", REQUEST,
     lambda c: c.start_request(2), None, REQUEST),
    ("node 1's first failure in attempt 2", lambda c: c.post_failure(2, 1, REPORT), "a2/fail/1", REPORT,
     lambda c: c.failure(2, 1), None, REPORT),
    ("node 1's ranks returned", lambda c: c.post_done(2, 1), "a2/done/1", b"1", lambda c: c.is_done(2, 1), False, True),
    ("node 0 stops attempt 2", lambda c: c.ask_stop(2), "a2/stop", b"1", lambda c: c.stop_asked(2), False, True),
    ("node 1's ranks are gone", lambda c: c.post_stopped(2, 1), "a2/stopped/1", b"1",
     lambda c: c.is_stopped(2, 1), False, True),
    ("node 1's ranks are quiet", lambda c: c.post_quiet(2, 1, QUIET), "a2/quiet/1", QUIET,
     lambda c: c.quiet(2, 1), None, QUIET),
    ("node 0 asks for round 3", lambda c: c.ask_confirm(2, 3), "a2/confirm", b"3", lambda c: c.confirm_asked(2), 0, 3),
    ("node 1 answers round 3", lambda c: c.post_confirmed(2, 1, 3, QUIET), "a2/confirmed/1/3", QUIET,
     lambda c: c.confirmed(2, 1, 3), None, QUIET),
    ("node 0 asks where the ranks are", lambda c: c.ask_where(2), "a2/where", b"1",
     lambda c: c.where_asked(2), False, True),
    ("node 1 says where", lambda c: c.post_where(2, 1, "rank 2 in all_reduce"), "a2/where/1", b"rank 2 in all_reduce",
     lambda c: c.where(2, 1), None, "rank 2 in all_reduce"),
]


@pytest.mark.parametrize(("said", "say", "key", "stored", "read", "before", "after"), TABLE, ids=[row[0] for row in TABLE])
def test_each_message_has_one_key_and_reads_back_typed(
    said: str, say: Call, key: str, stored: Any, read: Call, before: Any, after: Any
) -> None:
    fake = DictStore()
    control = ControlStore(fake)
    assert read(control) == before
    fake.data.clear()  # reading leaves nothing behind but counters at 0; the table is about what `say` writes
    say(control)
    assert list(fake.data) == [key]
    assert (fake.data[key] if isinstance(stored, bytes) else unship(fake.data[key])) == stored
    if said == "node 0 starts an attempt":
        return  # the counter is read by counting on: the next attempt is 1
    assert read(control) == after


def test_a_replacement_is_taken_once_and_forgets_the_old_join_and_refusal() -> None:
    fake = DictStore()
    control = ControlStore(fake)
    control.join(1, "127.0.0.3")
    control.refuse_replacement(1, "an earlier wait ran out")
    control.declare_lost(1)
    control.ask_replacement(1, 4)
    assert control.joined(1) is None and control.replacement_refused(1) is None
    assert control.take_replacement(1) == 4 and control.take_replacement(1) is None
    control.join(1, "127.0.0.4")
    control.replaced(1)
    assert control.joined(1) == "127.0.0.4" and not control.is_lost(1)


def test_output_batches_arrive_in_order_once_and_stop_at_one_not_written_yet() -> None:
    fake = DictStore()
    sender, reader = ControlStore(fake), ControlStore(fake)
    assert sender.send_output(0, 1, [(2, "stdout", "a\n")]) == 1
    assert sender.send_output(0, 1, [(3, "stderr", "b"), (2, "stdout", "c\n")]) == 2  # a piece of rank 3's line
    assert not sender.output_taken(0, 1, 1)
    fake.add("a0/out/1/count", 1)  # a third batch numbered by its sender, not written yet
    got = list(reader.take_output(0, 1, after=0))
    assert got == [(1, [(2, "stdout", "a\n")]), (2, [(3, "stderr", "b"), (2, "stdout", "c\n")])]
    assert sorted(fake.data) == ["a0/out/1/count"]  # each batch deleted once read
    assert sender.output_taken(0, 1, 1) and sender.output_taken(0, 1, 2)
    assert list(reader.take_output(0, 1, after=2)) == []  # batch 3 still not written: read on a later poll
    fake.set("a0/out/1/3", ship([(2, "stdout", "d\n")]))
    assert list(reader.take_output(0, 1, after=2)) == [(3, [(2, "stdout", "d\n")])]


def test_a_start_request_is_frozen_and_has_no_field_by_default() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        REQUEST.forks = False  # type: ignore[misc]
    with pytest.raises(TypeError):
        StartRequest(call=b"fn", backend="gloo")  # type: ignore[call-arg]
    assert {f.name for f in dataclasses.fields(StartRequest)} == {
        "call", "backend", "env", "master", "run_id", "attempt_env", "make_group", "stop_grace", "prefix_output",
        "forks", "diagnostics", "stall_timeout"}  # fmt: skip


def test_a_reported_failure_becomes_the_callers_rank_failure() -> None:
    raised = FailureRecord(None, "KeyError", "'lr'", "Traceback ...\nKeyError: 'lr'", 0.0, False)
    report = dataclasses.replace(REPORT, signal=None, exitcode=1, failure=raised,
                                 tail=tuple(f"line {i}" for i in range(60)))  # fmt: skip
    failure = rank_failure_of(report)
    assert (failure.rank, failure.pid, failure.exc_type, failure.kind) == (3, 42, "KeyError", FailureKind.EXCEPTION)
    assert failure.output_tail.splitlines() == [f"line {i}" for i in range(20, 60)]
    killed = rank_failure_of(REPORT)
    assert (killed.signal, killed.kind) == (9, FailureKind.CRASH)
