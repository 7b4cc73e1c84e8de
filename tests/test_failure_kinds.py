"""The failure vocabulary as pure tables: the Outcome a supervised child ends with, the FailureKind decided from
its typed fields (never from a message's words), the public words restart_on= and retries= use for each
kind, and the kinds levers9's errors carry. No process is started."""

from __future__ import annotations

import pickle
import signal

import pytest

from levers9.distributed import restarts
from levers9.errors import (
    FailureKind,
    JobCrashed,
    JobTimeout,
    NodeLost,
    RankFailed,
    RankFailure,
    RunTimeout,
    StallError,
)
from levers9.launch.outcomes import failure_kind
from levers9.procs.failure import Failure, capture
from levers9.procs.outcome import Outcome, StopReason, kind_of
from levers9.retries import RESTART_WORDS, RETRY_WORDS, Retries, RetryPolicy, restart_policy

K = FailureKind


def _raised(exc: BaseException, exitcode: int = 1) -> Outcome:
    """The outcome of a child that raised `exc` (recorded by the real codec) and left with `exitcode`."""
    return Outcome(pid=42, exitcode=exitcode, signal=None, failure=capture(exc, exitcode=exitcode), reported=True)


def _dist_backend_error() -> Failure:
    return Failure(None, "torch.distributed.DistBackendError", "NCCL error: remote process exited", "", 0.0, False)


# (outcome, its kind, restart_on='s word, retries='s word)
TABLE = [
    (Outcome(42, 0, None, value=b"v", reported=True), None, None, None),
    (Outcome(42, None, signal.SIGKILL), K.CRASH, "crash", "crash"),
    (Outcome(42, None, signal.SIGSEGV), K.CRASH, "crash", "crash"),
    (Outcome(42, 3, None), K.EXIT, "exception", "crash"),  # os._exit(3): nothing reported
    (Outcome(42, 0, None), K.EXIT, "exception", "crash"),  # exit 0 before returning a value
    (_raised(SystemExit(4), exitcode=4), K.EXIT, "exception", "crash"),  # sys.exit(4)
    (_raised(KeyError("lr")), K.EXCEPTION, "exception", "exception"),
    (_raised(RuntimeError("[pair.cc:553] Connection closed by peer [::1]:29500")), K.COMM, "comm", "exception"),
    (Outcome(42, 1, None, failure=_dist_backend_error(), reported=True), K.COMM, "comm", "exception"),
    (_raised(RuntimeError("CUDA error: uncorrectable ECC error encountered")), K.CRASH, "crash", "crash"),
    (Outcome(42, None, signal.SIGTERM, stopped_for=StopReason.TIMEOUT), K.TIMEOUT, "timeout", "timeout"),
    (Outcome(42, None, signal.SIGKILL, stopped_for=StopReason.STALL), K.STALL, "stall", "exception"),
    (Outcome(42, None, None, lost=True), K.LOST, "comm", "crash"),
]


@pytest.mark.parametrize(("outcome", "kind", "restart_word", "retry_word"), TABLE)
def test_each_outcome_has_one_kind_and_each_layer_one_word_for_it(
    outcome: Outcome, kind: FailureKind | None, restart_word: str | None, retry_word: str | None
) -> None:
    assert kind_of(outcome) == kind
    if kind is not None:
        policy = RetryPolicy()
        assert policy.word_for(kind, RESTART_WORDS) == restart_word == restarts.word(kind)
        assert policy.word_for(kind, RETRY_WORDS) == retry_word


def test_the_words_of_a_message_do_not_decide_the_kind() -> None:
    """A failure whose text merely mentions a peer or a card is the plain exception its fields say it is."""
    told = Failure(None, "ValueError", "Connection closed by peer; GPU is lost", "", 0.0, peer_loss=False)
    assert kind_of(Outcome(42, 1, None, failure=told, reported=True)) is K.EXCEPTION


def test_every_kind_but_queue_has_exactly_one_word_in_each_table() -> None:
    for table in (RESTART_WORDS, RETRY_WORDS):
        for kind in FailureKind:
            words = [word for word, kinds in table.items() if kind in kinds]
            assert words == [] if kind is K.QUEUE else len(words) == 1, (kind, words)


def test_the_default_policies_keep_their_public_meaning() -> None:
    assert restart_policy(None, None, None).kinds == {K.CRASH, K.COMM, K.LOST, K.STALL}
    assert Retries(1).kinds == {K.CRASH, K.EXIT, K.LOST, K.TIMEOUT}
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
