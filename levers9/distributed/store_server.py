"""A torch TCPStore served by this process, on a port it bound itself: the ranks' rendezvous store of one attempt
(on loopback, or on node 0's address across nodes) and the control store of a job across nodes (launch/ray_gang.py)."""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from collections.abc import Iterator
from typing import Any


def serve_store(host: str) -> tuple[Any, int]:
    """(the store, its port): a TCPStore server on `host`, on a port bound here first (port 0: nothing collides),
    so no other process can take the port between choosing and listening. It serves while the store object lives."""
    import torch.distributed as td

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind((host, 0))
        listener.listen(128)
        port = listener.getsockname()[1]
        store = td.TCPStore(host, port, None, True, datetime.timedelta(seconds=60),
                            wait_for_workers=False, master_listen_fd=os.dup(listener.fileno()))  # fmt: skip
    return store, port


@contextlib.contextmanager
def hosted_store(host: str = "127.0.0.1") -> Iterator[int]:
    """A rendezvous store on a loopback port this process bound itself (port 0: nothing collides, nothing
    reachable from other hosts), for as long as the block runs; yields its port. A run across nodes passes
    node 0's address as `host` instead."""
    store, port = serve_store(host)
    try:
        yield port
    finally:
        del store
