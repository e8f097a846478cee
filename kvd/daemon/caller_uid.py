"""Which local user is calling: the uid behind a TCP peer on this host.

A worker registers memory by naming a file in /dev/shm, and the daemon opens
it with its own rights. Without knowing who asks, any local user could name
another user's file (another tenant's KV cache) and read it through a
publication, or overwrite it through a pull. gRPC gives a handler only the
peer's address, so the caller's uid is read the way identd reads it: the
kernel's table of TCP sockets lists the caller's end of the connection, and
the uid that owns it. It is read with sock_diag (``sock_diag.py``), in one
pass: ``/proc/net/tcp`` lists a socket twice, or not at all, while others
come and go.

The connection is found exactly, as a pair, because an address is not
proof: any user may open a socket with SO_REUSEADDR on another user's
address and port (127.0.0.1 and a root worker's port, towards another of our
addresses), or bind another loopback address to it. So first our own end:
every socket on an address our listener answers on whose remote end is the
peer must be one, and this process's (by inode, from ``/proc/self/fd``).
Then the caller's end: every socket from the peer to an address we answer
on must be one, to exactly ours, and held by a process. Every live state
counts: a twin its user half-closed, closed or reset right after asking is
still a twin (its row shows uid 0 once closed, and a reset one of ours is no
longer listed at all: one such on our port refuses every caller until gRPC
closes it). Not LISTEN, and not TIME_WAIT: a connection in TIME_WAIT has
ended both ways, so gRPC has closed our end and cancelled its calls (and
counting it would let anyone block a worker's registrations for a minute by
closing a twin). Anything else is refused (``CallerUnlisted``), never let
through unchecked; a call whose connection has left the table entirely is
cancelled by gRPC, not caught here.

A peer whose end is not in this network namespace's table is on another host
(or behind a NAT or proxy, whose end it is): its user is not known (None).
A loopback peer always is in the table, so one not found is refused. Over a
Unix socket the peer string carries no address (the socket file's
permissions decide who connects): not known either.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import Callable

from kvd.core.errors import PermissionDenied
from kvd.daemon.sock_diag import LISTEN, TIME_WAIT, Address, TcpSocket, tcp_sockets, unmapped

_ENDED = (LISTEN, TIME_WAIT)  # not a live connection (the dump leaves TIME_WAIT out already)
# "ipv4:127.0.0.1:41234", "ipv6:[::1]:41234", "ipv6:%5B::1%5D:41234"
_PEER = re.compile(r"^(ipv4|ipv6):(?:\[|%5B)?([0-9A-Fa-f.:]+?)(?:\]|%5D)?:(\d+)$")


class CallerUnlisted(PermissionDenied):
    """A peer whose connection the kernel's table does not show as one exact pair."""


def tcp_caller_uid(peer: str, server_port: int, sockets: Callable[[int, int], list[TcpSocket]] = tcp_sockets,
                   own_sockets: Callable[[], dict[int, int]] | None = None) -> int | None:
    """The uid owning the caller's end of the TCP connection ``peer`` (a gRPC
    peer string) has to our ``server_port``; None for a peer that is not TCP,
    or whose end is on another host. Raises ``CallerUnlisted`` where the pair
    is not exactly one, or a loopback peer's end is not found.
    ``sockets(port, other)``: the live sockets with local ``port``, or local ``other`` towards
    remote ``port`` (``sock_diag.tcp_sockets``); ``own_sockets``: this process's sockets,
    inode to descriptor (``/proc/self/fd``)."""
    m = _PEER.match(peer)
    if m is None:
        return None
    try:
        addr = unmapped(ipaddress.ip_address(m.group(2)))
    except ValueError:
        return None
    caller: Address = (addr, int(m.group(3)))
    own = (own_sockets or _own_sockets)()
    try:
        rows = sockets(server_port, caller[1])
    except OSError as e:
        raise _unlisted(peer, server_port, f"the kernel's socket table could not be read: {e}") from e
    listed = {r.inode for r in rows if r.local[1] == server_port}
    served = [r.local[0] for r in rows if r.state == LISTEN and r.local[1] == server_port and r.inode in own]

    def ours(a: Address) -> bool:  # an address our listener answers on
        return a[1] == server_port and any(s == a[0] or s.is_unspecified for s in served)

    # Every live state: a connection its caller half-closed, closed or has
    # not yet seen accepted is still a second connection from that address.
    daemon_ends = [r for r in rows if r.state not in _ENDED and r.remote == caller and ours(r.local)]
    if len(daemon_ends) != 1:
        raise _unlisted(peer, server_port, f"{len(daemon_ends)} of this daemon's sockets are connected to it")
    if daemon_ends[0].inode not in own:
        raise _unlisted(peer, server_port, "the one socket connected to it is not this daemon's own")
    if any(_on_port(fd, inode, server_port) for inode, fd in own.items() if inode not in listed):
        # One of our connections was reset and is no longer listed: its caller is not known.
        raise _unlisted(peer, server_port, "a connection to this daemon was reset, and its far end is gone")
    caller_ends = [r for r in rows if r.state not in _ENDED and r.local == caller and ours(r.remote)]
    if not caller_ends and not addr.is_loopback:
        return None  # its end is not on this host
    if len(caller_ends) != 1:
        raise _unlisted(peer, server_port, f"its end is listed {len(caller_ends)} times")
    end = caller_ends[0]
    if end.remote != daemon_ends[0].local:
        raise _unlisted(peer, server_port, f"its end is connected to {end.remote[0]}, ours to it from {daemon_ends[0].local[0]}")
    if end.inode == 0:  # no process holds it (closed): the table shows uid 0
        raise _unlisted(peer, server_port, "its end is closed")
    return end.uid


def _unlisted(peer: str, server_port: int, why: str) -> CallerUnlisted:
    return CallerUnlisted(f"the connection from {peer} to port {server_port} is not one exact pair in the kernel's TCP table ({why}): "
                          "its user is not known, so it may not name shared memory")


def _own_sockets() -> dict[int, int]:
    """This process's sockets: inode to descriptor."""
    sockets = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if link.startswith("socket:["):
            sockets[int(link[8:-1])] = int(fd)
    return sockets


def _on_port(fd: int, inode: int, port: int) -> bool:
    """Whether descriptor ``fd`` is still socket ``inode``, TCP on local ``port`` (a copy of it is asked)."""
    try:
        copy = os.dup(fd)
    except OSError:
        return False  # closed meanwhile
    if os.fstat(copy).st_ino != inode:
        os.close(copy)
        return False  # closed meanwhile, and the number given to another socket
    try:
        s = socket.socket(fileno=copy)
    except OSError:
        os.close(copy)
        return False  # not a socket (the number was reused)
    with s:
        return s.type == socket.SOCK_STREAM and s.family in (socket.AF_INET, socket.AF_INET6) and s.getsockname()[1] == port
