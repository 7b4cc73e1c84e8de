"""The rendezvous host checked before a group is made: a MASTER_ADDR that does not resolve is one error
within seconds, naming the host and where it came from, instead of every rank waiting until killed."""

from __future__ import annotations

import socket
import threading

from levers9.errors import LauncherEnvError

RESOLVE_TIMEOUT_S = 10.0


def check_resolves(host: str, source: str, timeout: float = RESOLVE_TIMEOUT_S) -> None:
    """Return when `host` resolves to an address; LauncherEnvError naming `host` and `source` (the variable
    it came from) when it does not, or when the resolver gives no answer within `timeout` seconds."""
    answer: list[BaseException | None] = []

    def resolve() -> None:
        try:
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            answer.append(None)
        except OSError as exc:
            answer.append(exc)

    resolver = threading.Thread(target=resolve, name="levers9-resolve", daemon=True)  # getaddrinfo cannot be interrupted
    resolver.start()
    resolver.join(timeout)
    if answer and answer[0] is None:
        return
    seen = f"does not resolve ({answer[0]})" if answer else f"gave no answer from the resolver within {timeout:g} s"
    raise LauncherEnvError(
        f"The rendezvous host {host!r} (from {source}) {seen}, so the ranks could never meet. Expected a name or "
        f"address of rank 0's node that every node resolves: export MASTER_ADDR=<that node's address>, or add "
        f"the node's name to DNS or /etc/hosts."
    )
