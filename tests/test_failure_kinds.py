"""The failure vocabulary as pure tables: the Outcome a supervised child ends with, the FailureKind decided from
its typed fields (never from a message's words), the one public word restart_on= and retries= both use for
each kind (and the old words' meanings, kept with a warning), and the kinds levers9's errors carry. No
process is started."""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import warnings
from pathlib import Path

import pytest

from levers9.distributed import restarts
from levers9.distributed.control_store import Report
from levers9.distributed.nodes import rank_failure_of
from levers9.errors import (
    ConfigError,
    FailureKind,
    JobCrashed,
    JobTimeout,
    NodeLost,
    RankFailed,
    RankFailure,
    RunTimeout,
    StallError,
)
from levers9.launch import outcomes
from levers9.launch.outcomes import failure_kind
from levers9.procs.failure import FailureRecord, capture, ship
from levers9.procs.outcome import Outcome, StopReason, kind_of
from levers9.retries import WORDS, Retries, restart_policy, word_for, words_adding
from levers9.state_files import Losses

pytestmark = pytest.mark.fast

K = FailureKind


def _raised(exc: BaseException, exitcode: int = 1) -> Outcome:
    """The outcome of a child that raised `exc` (recorded by the real codec) and left with `exitcode`."""
    return Outcome(pid=42, exitcode=exitcode, signal=None, failure=capture(exc, exitcode=exitcode), reported=True)


def _dist_backend_error() -> FailureRecord:
    return FailureRecord(None, "torch.distributed.DistBackendError", "NCCL error: remote process exited", "", 0.0, False)


# (outcome, its kind, the kind retries= sees in the error a job process raises for it): one kind whichever layer
# started the child, except where a job's own exception is raised as it is (the job layer reads no kind from a
# raised exception: a failed collective or card inside a job is an "exception" to retries=, a difference pinned
# here, not chosen)
TABLE = [
    (Outcome(42, 0, None, value=b"v", reported=True), None, None),
    (Outcome(42, None, signal.SIGKILL), K.CRASH, K.CRASH),
    (Outcome(42, None, signal.SIGSEGV), K.CRASH, K.CRASH),
    (Outcome(42, 3, None), K.EXIT, K.EXIT),  # os._exit(3): nothing reported
    (Outcome(42, 0, None), K.EXIT, K.EXIT),  # exit 0 before returning a value
    (_raised(SystemExit(4), exitcode=4), K.EXIT, K.EXIT),  # sys.exit(4)
    (_raised(KeyError("lr")), K.EXCEPTION, K.EXCEPTION),
    (_raised(RuntimeError("[pair.cc:553] Connection closed by peer [::1]:29500")), K.COMM, K.EXCEPTION),
    (Outcome(42, 1, None, failure=_dist_backend_error(), reported=True), K.COMM, K.EXCEPTION),
    (_raised(RuntimeError("CUDA error: uncorrectable ECC error encountered")), K.CRASH, K.EXCEPTION),
    (Outcome(42, None, signal.SIGTERM, stopped_for=StopReason.TIMEOUT), K.TIMEOUT, K.TIMEOUT),
    (Outcome(42, None, signal.SIGKILL, stopped_for=StopReason.STALL), K.STALL, None),  # no job is stopped for a stall
    (Outcome(42, None, None, lost=True), K.LOST, K.LOST),
]


@pytest.mark.parametrize(("outcome", "kind", "job_kind"), TABLE)
def test_each_outcome_has_one_kind_and_one_word_in_both_layers(
    outcome: Outcome, kind: FailureKind | None, job_kind: FailureKind | None
) -> None:
    assert kind_of(outcome) == kind
    if kind is not None:
        assert restarts.word(kind) == word_for(kind) == kind.value
        assert WORDS[word_for(kind)] == {kind}


@pytest.mark.parametrize(("outcome", "kind", "job_kind"), [row for row in TABLE if row[1] is not K.STALL])
def test_a_job_process_raises_an_error_of_the_kind_its_outcome_has(
    outcome: Outcome, kind: FailureKind | None, job_kind: FailureKind | None, tmp_path: Path
) -> None:
    """The job layer's one builder (launch.outcomes.finish) ends each outcome of the table in an error of its
    kind, as the rank layer's failure records carry kind_of(outcome) (test_a_runs_errors_carry_their_kind)."""
    if kind is None:
        outcome = dataclasses.replace(outcome, value=ship("v"))
    with outcomes.JobAttempt("cell #0", 0, 1, 1, tmp_path, Losses(tmp_path)) as run:
        try:
            value = outcomes.finish(run, outcome, 5.0, {})
        except BaseException as exc:  # noqa: BLE001 - the table holds the job's own exceptions too
            assert failure_kind(exc) == job_kind
        else:
            assert kind is None and value == "v"


@pytest.mark.parametrize(("outcome", "kind", "job_kind"), [
    row for row in TABLE if row[1] is not None and row[0].stopped_for is None and not row[0].lost and row[0].exitcode != 0
])
def test_a_rank_on_another_node_fails_with_the_kind_its_outcome_has(
    outcome: Outcome, kind: FailureKind, job_kind: FailureKind | None
) -> None:
    """A rank that ended this way on another node reaches the caller (nodes.rank_failure_of) as the same kind the
    one-node path gives it (kind_of)."""
    report = Report(rank=3, node=1, address="127.0.0.3", pid=outcome.pid, exitcode=outcome.exitcode,
                    signal=outcome.signal, failure=outcome.failure, tail=(), wall=0.0)  # fmt: skip
    assert rank_failure_of(report).kind == kind


# restart_on= and Retries(on=): (the words given, the kinds they name, whether that warns of a changed meaning)
WORD_TABLE = [
    (("crash",), {K.CRASH}, {K.CRASH, K.EXIT, K.LOST}),
    (("exit",), {K.EXIT}, {K.EXIT}),
    (("exception",), {K.EXCEPTION, K.EXIT}, {K.EXCEPTION, K.COMM, K.STALL}),
    (("comm",), {K.COMM, K.LOST}, {K.COMM}),
    (("lost",), {K.LOST}, {K.LOST}),
    (("stall",), {K.STALL}, {K.STALL}),
    (("timeout",), {K.TIMEOUT}, {K.TIMEOUT}),
    (("comm", "lost"), {K.COMM, K.LOST}, {K.COMM, K.LOST}),
    (("exception", "exit"), {K.EXCEPTION, K.EXIT}, {K.EXCEPTION, K.EXIT, K.COMM, K.STALL}),
    (("crash", "exit", "lost"), {K.CRASH, K.EXIT, K.LOST}, {K.CRASH, K.EXIT, K.LOST}),
    (("exception", "comm", "stall"), {K.EXCEPTION, K.EXIT, K.COMM, K.LOST, K.STALL}, {K.EXCEPTION, K.COMM, K.STALL}),
]


@pytest.mark.parametrize(("words", "restart_kinds", "retry_kinds"), WORD_TABLE)
def test_the_retry_words_of_both_keywords(
    words: tuple[str, ...], restart_kinds: set[FailureKind], retry_kinds: set[FailureKind]
) -> None:
    """Each word names its own kind in both; an old word keeps its wider meaning with a DeprecationWarning
    (naming the words that say the same today), and those words mean it without one."""
    named = frozenset().union(*(WORDS[word] for word in words))
    for make, kinds, keyword in ((lambda w: restart_policy(1, w, 0), restart_kinds, "restart_on="),
                                 (lambda w: Retries(1, on=w), retry_kinds, "Retries(on=")):  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert make(words).kinds == kinds
        if kinds == named:
            assert caught == []
        else:
            (warning,) = caught
            assert warning.category is DeprecationWarning and warning.filename == __file__
            today = tuple(str(warning.message).split(f"Pass {keyword}")[1].split(")")[0].strip("(").replace("'", "").split(", "))
            assert frozenset().union(*(WORDS[word] for word in today)) == kinds
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                assert make(today).kinds == kinds


def test_a_suggested_restart_on_means_what_it_meant_and_does_not_warn() -> None:
    assert words_adding(("crash", "comm", "lost", "stall"), K.EXCEPTION, "restart_on") == (
        "crash", "comm", "lost", "stall", "exception", "exit")
    assert words_adding(("crash",), K.STALL, "restart_on") == ("crash", "stall")
    assert words_adding(("comm",), K.CRASH, "restart_on") == ("comm", "crash", "lost")


def test_the_words_of_a_message_do_not_decide_the_kind() -> None:
    """A failure whose text merely mentions a peer or a card is the plain exception its fields say it is."""
    told = FailureRecord(None, "ValueError", "Connection closed by peer; GPU is lost", "", 0.0, peer_loss=False)
    assert kind_of(Outcome(42, 1, None, failure=told, reported=True)) is K.EXCEPTION


def test_every_kind_but_queue_has_exactly_one_word_and_no_word_is_unknown() -> None:
    assert [kind for kinds in WORDS.values() for kind in kinds] == [kind for kind in FailureKind if kind is not K.QUEUE]
    with pytest.raises(ConfigError, match="names 'oom'"):
        restart_policy(1, ("oom",), 0)


def test_the_default_policies_keep_their_public_meaning() -> None:
    assert restart_policy(None, None, None).kinds == {K.CRASH, K.COMM, K.LOST, K.STALL}
    assert Retries(1).kinds == {K.CRASH, K.EXIT, K.LOST, K.TIMEOUT}
    with pytest.warns(DeprecationWarning, match=r"Pass restart_on=\('exception', 'exit'\)"):
        assert restart_policy(2, ("exception",), 0).kinds == {K.EXCEPTION, K.EXIT}
    assert [Retries(3, initial_delay=1, max_delay=3).delay(n) for n in (2, 3, 4)] == [1.0, 2.0, 3.0]
    assert restart_policy(1, None, 5).delay(2) == restart_policy(1, None, 5).delay(9) == 5.0


def test_an_oom_kill_is_named_from_the_cgroup_counts_not_from_the_report_text() -> None:
    assert Outcome(42, None, signal.SIGKILL, oom_counts=(0, 1)).oom_killed
    assert not Outcome(42, None, signal.SIGKILL, oom_counts=(1, 1)).oom_killed
    assert not Outcome(42, None, signal.SIGKILL, oom_counts=(None, 1)).oom_killed
    killed = RankFailed("report", RankFailure(rank=1, pid=42, signal=signal.SIGKILL, oom_killed=True, kind=K.CRASH))
    assert restarts.cause_of(killed, None, None).endswith("(the out-of-memory killer)")
    plain = RankFailed("the out-of-memory killer fired (words only)", RankFailure(rank=1, pid=42, signal=signal.SIGKILL))
    assert "out-of-memory" not in restarts.cause_of(plain, None, None)


@pytest.mark.parametrize(("error", "kind"), [
    (RankFailed("a rank failed", RankFailure(rank=1, pid=42, signal=signal.SIGKILL, kind=K.CRASH)), K.CRASH),
    (RankFailed("a rank failed", RankFailure(rank=1, pid=42, exitcode=3, kind=K.EXIT)), K.EXIT),
    (RunTimeout("timed out"), K.TIMEOUT),
    (StallError("stalled"), K.STALL),
    (NodeLost("lost", node="127.0.0.3", ranks=(2, 3)), K.LOST),
    (ValueError("before any rank ran"), None),
])
def test_a_runs_errors_carry_their_kind(error: Exception, kind: FailureKind | None) -> None:
    assert restarts.kind_of_error(error) == kind


def test_a_ranks_own_exception_takes_the_kind_of_the_failure_it_was_raised_from() -> None:
    original = KeyError("lr")
    original.__cause__ = RankFailed("report", RankFailure(rank=1, pid=5, exc_type="KeyError", kind=K.EXCEPTION))
    assert restarts.kind_of_error(original) is K.EXCEPTION


@pytest.mark.parametrize(("error", "kind"), [
    (JobTimeout("cell #0 exceeded timeout=5s"), K.TIMEOUT),
    (JobTimeout("cell #0 waited 5 s (queue_timeout)", kind="queue"), K.QUEUE),
    (JobTimeout("words that say exceeded timeout", kind="queue"), K.QUEUE),
    (JobCrashed("cell #0 was killed by SIGKILL"), K.CRASH),
    (JobCrashed("cell #0 exited with code 3", kind=K.EXIT), K.EXIT),
    (KeyError("lr"), K.EXCEPTION),
])
def test_a_jobs_errors_carry_their_kind(error: BaseException, kind: FailureKind) -> None:
    assert failure_kind(error) == kind


def test_the_kinds_survive_pickling() -> None:
    assert pickle.loads(pickle.dumps(JobTimeout("waited", kind="queue"))).kind is K.QUEUE
    assert pickle.loads(pickle.dumps(JobCrashed("lost", kind=K.LOST))).kind is K.LOST
    assert pickle.loads(pickle.dumps(Outcome(42, None, signal.SIGKILL, stopped_for=StopReason.STALL))).stopped_for is StopReason.STALL


def test_a_jobs_failure_names_its_cell_and_the_old_rank_spelling_still_reads_it_with_a_warning() -> None:
    from levers9.errors import JobFailure, ProcessFailure

    failure = JobFailure(cell=3, pid=42, signal=signal.SIGKILL, kind=K.CRASH)
    assert isinstance(failure, ProcessFailure) and failure.describe().startswith("cell #3 (pid 42) was killed by SIGKILL")
    with pytest.warns(DeprecationWarning, match=r"read \.cell"):
        assert failure.rank == 3
    crashed = pickle.loads(pickle.dumps(JobCrashed("cell #3 died", failure)))
    assert crashed.failure == failure


def test_an_attempt_holds_no_descriptor_until_its_job_writes_and_leaves_both_logs(tmp_path: Path) -> None:
    """A sweep's attempts that wait (a SLURM array's pending cells, each with its attempt begun) hold no file
    descriptor; at the end every attempt has both logs, what the job wrote in them and in its tail."""
    fds = lambda: len(os.listdir("/proc/self/fd"))  # noqa: E731
    for i in range(50):
        (tmp_path / str(i)).mkdir()
    before = fds()
    waiting = [outcomes.JobAttempt(f"cell #{i}", i, 1, 1, tmp_path / str(i), Losses(tmp_path)) for i in range(50)]
    assert fds() == before
    waiting[0].output("stdout", "first line\n")
    waiting[0].output("stdout", "a long line's first piece, ")
    waiting[0].output("stdout", "and its end\n")
    assert fds() == before + 1
    for attempt in waiting:
        attempt.close()
    assert fds() == before
    assert (tmp_path / "0" / "stdout.log").read_text() == "first line\na long line's first piece, and its end\n"
    assert waiting[0].tail.text == "first line\na long line's first piece, and its end\n"
    assert all((tmp_path / str(i) / name).read_bytes() == b"" for i in range(1, 50) for name in ("stdout.log", "stderr.log"))
