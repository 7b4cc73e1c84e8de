"""A rank's or job's own signal handler runs while it computes, on every Python levers9 supports.

CPython 3.13 and later run no Python signal handler in a child forked from a thread other than the main one
until a system call returns EINTR (levers9 forks from its forker thread): a rank that computes when it is
preempted would never save its checkpoint. Up to 3.12, a signal the kernel hands to another thread of the
process (torch's, gloo's) leaves a main thread that computes without releasing the GIL running no handler
until its own next signal. Each case here signals a process that then computes (pure Python and a torch op,
never a sleep, which would hide the fault) and asks how long its handler took.
tests/test_terminate.py checks the same through the caller, which forwards a SIGTERM or SIGHUP it got."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from levers9 import distributed as dist
from levers9.launch import job
from tests import jobfns
from tests.jobfns import train_step

pytestmark = pytest.mark.procs

PATIENCE = 20.0  # seconds of computing after which the handler counts as never run


def send_me(signum: int) -> subprocess.Popen[bytes]:
    """Another process that sends `signum` to this one, as a scheduler or a terminal does (`os.kill` of its own
    pid would run the handler at once: CPython checks for signals right after a kill of its own process)."""
    kill = "import os, sys; os.kill(int(sys.argv[1]), int(sys.argv[2]))"
    return subprocess.Popen([sys.executable, "-c", kill, str(os.getpid()), str(int(signum))])


def seconds_until_handled(signum: int) -> float | None:
    """Put a handler for `signum` in place, have it sent to this process, compute: the seconds until the handler
    ran, or None if it did not within PATIENCE."""
    ran: list[float] = []
    signal.signal(signum, lambda *_: ran.append(time.monotonic()))
    start = time.monotonic()
    sender = send_me(signum)
    while not ran and time.monotonic() - start < PATIENCE:
        train_step()
    sender.wait()
    return ran[0] - start if ran else None


def interrupted_while_computing(_: object = None) -> str:
    """SIGINT to this process under Python's default handler, then compute: what reached the code."""
    start = time.monotonic()
    sender = send_me(signal.SIGINT)
    try:
        while time.monotonic() - start < PATIENCE:
            train_step()
    except KeyboardInterrupt:
        return "KeyboardInterrupt"
    finally:
        sender.wait()
    return "nothing"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1], ids=lambda s: signal.Signals(s).name)
def test_a_ranks_own_handler_runs_while_it_computes(signum: int, start_method: str) -> None:
    seconds = dist.run(seconds_until_handled, signum, nprocs=2, start_method=start_method)
    assert seconds is not None, f"Python {sys.version.split()[0]}: the rank's handler never ran while it computed"
    assert seconds < 5


@pytest.mark.timeout(120)
def test_a_ranks_default_sigint_handler_raises_keyboard_interrupt_while_it_computes() -> None:
    assert dist.run(interrupted_while_computing, None, nprocs=2) == "KeyboardInterrupt"


@pytest.mark.timeout(120)
def test_a_job_processs_own_handler_runs_while_it_computes() -> None:
    seconds = job()(seconds_until_handled).remote(signal.SIGTERM)
    assert seconds is not None, f"Python {sys.version.split()[0]}: the job's handler never ran while it computed"
    assert seconds < 5
    assert job()(interrupted_while_computing).remote() == "KeyboardInterrupt"


@pytest.mark.timeout(120)
def test_the_ranks_of_a_job_run_their_own_handlers_while_they_compute() -> None:
    """Forked twice (the job from the caller's forker thread, its ranks from the job's): each process relays for
    itself, and a rank closes the relay pipe it inherited from its job."""
    seconds = job()(ranks_time_their_handler).remote()
    assert seconds is not None, f"Python {sys.version.split()[0]}: the handler of a job's rank never ran while it computed"
    assert seconds < 5


def ranks_time_their_handler() -> float | None:
    return dist.run(seconds_until_handled, signal.SIGUSR1, nprocs=2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_ranks_handler_runs_while_it_computes_when_another_thread_got_the_signal(start_method: str) -> None:
    """Up to CPython 3.12 a signal handled on a thread other than the main one does not make a computing main thread
    run the Python handler (bpo-40010): levers9's relay does (interpreter.relay_signals_to_main)."""
    seconds = dist.run(jobfns.seconds_until_handled_from_a_thread_in_c, signal.SIGUSR1, nprocs=2, start_method=start_method)
    assert seconds is not None, f"Python {sys.version.split()[0]}: the rank's handler never ran while it computed"
    assert seconds < 5


@pytest.mark.timeout(120)
def test_a_job_processs_handler_runs_while_it_computes_when_another_thread_got_the_signal() -> None:
    seconds = job()(jobfns.seconds_until_handled_from_a_thread_in_c).remote(signal.SIGTERM)
    assert seconds is not None, f"Python {sys.version.split()[0]}: the job's handler never ran while it computed"
    assert seconds < 5
