"""A torch TCPStore served by this process, on a port it bound itself: the ranks' rendezvous store of one attempt
(on loopback, or on node 0's address across nodes) and the control store of a job across nodes (launch/ray_gang.py,
distributed/torchrun_nodes.py)."""

from __future__ import annotations

import contextlib
import datetime
import errno
import logging
import os
import socket
from collections.abc import Iterator
from typing import Any

log = logging.getLogger("levers9.distributed")


def serve_store(host: str, port: int = 0) -> tuple[Any, int]:
    """(the store, its port): a TCPStore server listening on `host` alone, on `port` (0: one the kernel picks, so
    nothing collides), bound here first so no other process can take the port between choosing and listening.
    OSError when `host` is not this machine's or `port` is taken. It serves while the store object lives."""
    import torch.distributed as td

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        if port:  # a port named in advance (a run across nodes): free again at once after the last run on it
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(128)
        port = listener.getsockname()[1]
        store = td.TCPStore(host, port, None, True, datetime.timedelta(seconds=60),
                            wait_for_workers=False, master_listen_fd=os.dup(listener.fileno()))  # fmt: skip
    return store, port


@contextlib.contextmanager
def hosted_store(host: str = "127.0.0.1", preferred_port: int | None = None) -> Iterator[int]:
    """A rendezvous store on a loopback port this process bound itself (port 0: nothing collides, nothing
    reachable from other hosts), for as long as the block runs; yields its port. A run across nodes passes
    node 0's address as `host` instead. `preferred_port` (levers9 run --master-port) is used when it is free;
    when it is taken, a free port is, and a warning says so."""
    store, port = None, 0
    if preferred_port:
        try:
            store, port = serve_store(host, preferred_port)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
    if store is None:
        store, port = serve_store(host)
        if preferred_port:
            log.warning("--master-port %d is in use on %s; the ranks get MASTER_PORT=%d, a free port, instead",
                        preferred_port, host, port)  # fmt: skip
    try:
        yield port
    finally:
        del store
