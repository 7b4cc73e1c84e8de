"""Prints, on rank 0, the addresses its launcher (the parent process) listens on, as one JSON line."""

import json
import os
import socket
import struct


def listening(pid: int) -> list[str]:
    """host:port of every TCP socket `pid` listens on (from /proc/net/tcp and tcp6)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:  # closed since it was listed: the launcher opens and closes pipes as ranks start
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)
                words = b"".join(struct.pack("<I", w) for w in struct.unpack(f">{len(raw) // 4}I", raw))
                found.append(f"{socket.inet_ntop(family, words)}:{int(port, 16)}")
    return found


if os.environ["RANK"] == "0":
    print("LISTENS " + json.dumps(listening(os.getppid())), flush=True)
