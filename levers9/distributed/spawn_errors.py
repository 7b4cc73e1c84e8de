"""What `distributed.spawn` raises: torch.multiprocessing.spawn's own exception types, that are levers9's too.

Code written for mp.spawn catches `ProcessRaisedException` (a process raised) and `ProcessExitedException` (it
exited with a code or died by a signal) and reads `.error_index`, `.error_pid`, `.exit_code` and `.signal_name`;
code written for levers9 catches `RankFailed` and reads `.failure` and `.kind`. These two classes are both, with
mp.spawn's message. Loaded with `spawn` (it imports torch), not with levers9.

Each is made by mp.spawn's own `__init__` (it sets `msg`, `error_index`, `error_pid` ...), then given its failure.
RankFailed's `__init__` is not called: its `super().__init__(message)` would reach mp.spawn's with the message
alone on Python 3.14, whose built-in exception types no longer define an `__init__` of their own.
"""

from __future__ import annotations

from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

from levers9.errors import RankCrashed, RankFailed, RankFailure


class ProcessRaised(RankFailed, ProcessRaisedException):
    """A process of `spawn` raised: mp.spawn's ProcessRaisedException, and levers9's RankFailed."""

    def __init__(self, msg: str, error_index: int, error_pid: int, failure: RankFailure | None = None) -> None:
        ProcessRaisedException.__init__(self, msg, error_index, error_pid)
        self.failure = failure

    def __reduce__(self) -> tuple[type[ProcessRaised], tuple[str, int, int, RankFailure | None]]:
        return type(self), (self.msg, self.error_index, self.error_pid, self.failure)


class ProcessExited(RankCrashed, ProcessExitedException):
    """A process of `spawn` exited with a code or died by a signal, raising nothing: mp.spawn's
    ProcessExitedException, and levers9's RankCrashed. `exit_code` is negative for a signal, as mp.spawn's."""

    def __init__(self, msg: str, error_index: int, error_pid: int, exit_code: int, signal_name: str | None = None,
                 failure: RankFailure | None = None) -> None:  # fmt: skip
        ProcessExitedException.__init__(self, msg, error_index, error_pid, exit_code, signal_name)
        self.failure = failure

    def __reduce__(self) -> tuple[type[ProcessExited], tuple[str, int, int, int, str | None, RankFailure | None]]:
        return type(self), (self.msg, self.error_index, self.error_pid, self.exit_code, self.signal_name, self.failure)
