"""Which local user is calling: the uid behind a TCP peer on this host.

A worker registers memory by naming a file in /dev/shm, and the daemon opens
it with its own rights. Without knowing who asks, any local user could name
another user's file (another tenant's KV cache) and read it through a
publication, or overwrite it through a pull. gRPC gives a handler only the
peer's address, so the caller's uid is read the way identd reads it: the
kernel's table of TCP sockets (``/proc/net/tcp``, ``tcp6``) lists the
caller's end of the connection, and the uid that owns it.

The connection is found exactly, as a pair, because an address is not
proof: any user may open a socket with SO_REUSEADDR on another user's
address and port (127.0.0.1 and a root worker's port, towards another of our
addresses), or bind another loopback address to it. So first our own end:
the socket of this process (by inode, from ``/proc/self/fd``) whose remote
end is the peer, on our port; it must be one. Then the caller's end: the
socket from the peer to exactly that address and port; it must be one too.
Anything else is refused (``CallerUnlisted``), never let through unchecked.

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
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvd.core.errors import PermissionDenied

TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
ESTABLISHED = "01"
# "ipv4:127.0.0.1:41234", "ipv6:[::1]:41234", "ipv6:%5B::1%5D:41234"
_PEER = re.compile(r"^(ipv4|ipv6):(?:\[|%5B)?([0-9A-Fa-f.:]+?)(?:\]|%5D)?:(\d+)$")

Address = tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]


class CallerUnlisted(PermissionDenied):
    """A peer whose connection the kernel's table does not show as one exact pair."""


@dataclass(frozen=True)
class _Socket:
    """One established row of the kernel's TCP table."""

    local: Address
    remote: Address
    uid: int
    inode: int


def tcp_caller_uid(peer: str, server_port: int, tables: tuple[str, ...] = TCP_TABLES,
                   own_inodes: Callable[[], set[int]] | None = None) -> int | None:
    """The uid owning the caller's end of the TCP connection ``peer`` (a gRPC
    peer string) has to our ``server_port``; None for a peer that is not TCP,
    or whose end is on another host. Raises ``CallerUnlisted`` where the pair
    is not exactly one, or a loopback peer's end is not found.
    ``own_inodes``: the inodes of this process's sockets (``/proc/self/fd``)."""
    m = _PEER.match(peer)
    if m is None:
        return None
    try:
        addr = _unmapped(ipaddress.ip_address(m.group(2)))
    except ValueError:
        return None
    caller: Address = (addr, int(m.group(3)))
    rows = list(_sockets(tables, f":{caller[1]:04X}"))  # only rows with the peer's port on either end
    own = (own_inodes or _own_socket_inodes)()
    ours = [r for r in rows if r.remote == caller and r.local[1] == server_port and r.inode in own]
    if len(ours) != 1:
        raise _unlisted(peer, server_port, f"{len(ours)} of this daemon's sockets are connected to it")
    theirs = [r for r in rows if r.local == caller and r.remote == ours[0].local]
    if not theirs and not addr.is_loopback:
        return None  # its end is not on this host
    if len(theirs) != 1:
        raise _unlisted(peer, server_port, f"its end is listed {len(theirs)} times")
    return theirs[0].uid


def _unlisted(peer: str, server_port: int, why: str) -> CallerUnlisted:
    return CallerUnlisted(f"the connection from {peer} to port {server_port} is not one exact pair in the kernel's TCP table ({why}): "
                          "its user is not known, so it may not name shared memory")


def _unmapped(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """``::ffff:a.b.c.d`` as ``a.b.c.d``: one address, however a socket wrote it."""
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def _address(field: str) -> Address:
    """A table's ``HEX:PORT``. The kernel prints each 32-bit word of the
    address as a host-order integer, so its bytes are the host's order."""
    hex_addr, _, hex_port = field.partition(":")
    raw = b"".join(int(hex_addr[i:i + 8], 16).to_bytes(4, sys.byteorder) for i in range(0, len(hex_addr), 8))
    return _unmapped(ipaddress.ip_address(raw)), int(hex_port, 16)


def _sockets(tables: tuple[str, ...], port_hex: str) -> Iterator[_Socket]:
    """The established rows with ``port_hex`` at the end of either address."""
    for path in tables:
        try:
            with open(path) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue  # no IPv6: no tcp6
        for line in lines:
            if port_hex not in line:
                continue
            # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode ...
            fields = line.split()
            if len(fields) > 9 and fields[3] == ESTABLISHED and (fields[1].endswith(port_hex) or fields[2].endswith(port_hex)):
                yield _Socket(_address(fields[1]), _address(fields[2]), int(fields[7]), int(fields[9]))


def _own_socket_inodes() -> set[int]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    return inodes
