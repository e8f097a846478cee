"""Which local user is calling: the uid behind a loopback TCP peer.

A worker registers memory by naming a file in /dev/shm, and the daemon opens
it with its own rights. Without knowing who asks, any local user could name
another user's file (another tenant's KV cache) and read it through a
publication, or overwrite it through a pull. gRPC gives a handler only the
peer's address, so the caller's uid is read the way identd reads it: the
kernel's table of TCP sockets (``/proc/net/tcp``, ``tcp6``) lists, for the
connection from the peer's port to our gRPC port, the uid that owns the
caller's end. Over a Unix socket the peer string carries no address (the
socket file's permissions decide who connects), and a peer off this host has
no uid here: for those the caller is not known (None).
"""

from __future__ import annotations

import re

TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
ESTABLISHED = "01"
# "ipv4:127.0.0.1:41234", "ipv6:[::1]:41234", "ipv6:%5B::1%5D:41234"
_LOOPBACK_PEER = re.compile(r"^(?:ipv4:127\.\d+\.\d+\.\d+|ipv6:(?:\[::1\]|%5B::1%5D)):(\d+)$")


def loopback_caller_uid(peer: str, server_port: int, tables: tuple[str, ...] = TCP_TABLES) -> int | None:
    """The uid owning the caller's end of the loopback TCP connection ``peer``
    (a gRPC peer string) has to ``server_port``; None for any other peer, or
    where the kernel's table does not list the connection."""
    m = _LOOPBACK_PEER.match(peer)
    if m is None:
        return None
    return _uid_of(int(m.group(1)), server_port, tables)


def _uid_of(local_port: int, remote_port: int, tables: tuple[str, ...]) -> int | None:
    """The uid of the established socket from ``local_port`` to ``remote_port``.

    Seen from the caller's socket: its local end is the peer's port, its remote
    end our server port (loopback, so both ends are in this network namespace's table)."""
    want_local, want_remote = f":{local_port:04X}", f":{remote_port:04X}"
    for path in tables:
        try:
            with open(path) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            # sl local_address rem_address st tx:rx tr:when retrnsmt uid ...
            fields = line.split()
            if len(fields) > 7 and fields[3] == ESTABLISHED and fields[1].endswith(want_local) and fields[2].endswith(want_remote):
                return int(fields[7])
    return None
