"""The failure vocabulary as pure tables: what kind of failure restarts= and retries= see, decided from typed
fields of the failure, never from the words of a message."""

from __future__ import annotations

import pickle
import signal

import pytest

from levers9.distributed import restarts
from levers9.errors import JobCrashed, JobTimeout, RankFailed, RankFailure, RunTimeout, StallError
from levers9.launch.outcomes import failure_kind


def _raised(**fields: object) -> RankFailed:
    return RankFailed("distributed.run: a rank failed", RankFailure(rank=1, pid=42, **fields))  # type: ignore[arg-type]


@pytest.mark.parametrize(("error", "kind"), [
    (_raised(signal=signal.SIGKILL), "crash"),
    (_raised(signal=signal.SIGSEGV), "crash"),
    (_raised(exitcode=3), "exception"),  # sys.exit(3): the rank's own code chose to leave
    (_raised(exc_type="torch.distributed.DistBackendError", message="gloo failed"), "comm"),
    (_raised(exc_type="RuntimeError", message="Connection closed by peer [127.0.0.1]:1234"), "comm"),
    (_raised(exc_type="RuntimeError", message="CUDA error: uncorrectable ECC error encountered"), "crash"),
    (_raised(exc_type="KeyError", message="'lr'"), "exception"),
    (RunTimeout("timed out"), "timeout"),
    (StallError("stalled"), "stall"),
    (ValueError("before any rank ran"), None),
])
def test_restart_kinds(error: Exception, kind: str | None) -> None:
    assert restarts.classify(error, timeout=5, stall_timeout=2)[0] == kind


def test_an_oom_kill_is_named_from_its_field_not_from_the_report_text() -> None:
    killed = _raised(signal=signal.SIGKILL, oom_killed=True)
    assert restarts.classify(killed, None, None)[1].endswith("(the out-of-memory killer)")
    plain = RankFailed("the out-of-memory killer fired (words only)", RankFailure(rank=1, pid=42, signal=signal.SIGKILL))
    assert "out-of-memory" not in restarts.classify(plain, None, None)[1]


@pytest.mark.parametrize(("error", "kind"), [
    (JobTimeout("cell #0 exceeded timeout=5s"), "timeout"),
    (JobTimeout("cell #0 waited 5 s (queue_timeout)", kind="queue"), "queue"),
    (JobTimeout("words that say exceeded timeout", kind="queue"), "queue"),
    (JobCrashed("cell #0 was killed by SIGKILL"), "crash"),
    (KeyError("lr"), "exception"),
])
def test_retry_kinds(error: BaseException, kind: str) -> None:
    assert failure_kind(error) == kind


def test_a_job_timeouts_kind_survives_pickling() -> None:
    assert pickle.loads(pickle.dumps(JobTimeout("waited", kind="queue"))).kind == "queue"
