"""Which local user is calling: the uid behind a loopback TCP peer.

A worker registers memory by naming a file in /dev/shm, and the daemon opens
it with its own rights. Without knowing who asks, any local user could name
another user's file (another tenant's KV cache) and read it through a
publication, or overwrite it through a pull. gRPC gives a handler only the
peer's address, so the caller's uid is read the way identd reads it: the
kernel's table of TCP sockets (``/proc/net/tcp``, ``tcp6``) lists the
caller's end of the connection, and the uid that owns it.

That end is found by its whole address, not its port alone: any user may bind
another loopback address (127.0.0.2, ``::ffff:127.0.0.2``) to a port that a
root worker, or the daemon itself, uses on 127.0.0.1, and a match on ports
would then find root's socket. The caller's socket is the one whose local
address is exactly the peer's and whose remote end is our port on a loopback
address; it must be listed exactly once. A loopback peer not found so is
refused (``CallerUnlisted``), never let through unchecked.

Over a Unix socket the peer string carries no address (the socket file's
permissions decide who connects), and a peer off this host has no uid here:
for those the caller is not known (None).
"""

from __future__ import annotations

import ipaddress
import re

from kvd.core.errors import PermissionDenied

TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
ESTABLISHED = "01"
# "ipv4:127.0.0.1:41234", "ipv6:[::1]:41234", "ipv6:%5B::1%5D:41234"
_PEER = re.compile(r"^(ipv4|ipv6):(?:\[|%5B)?([0-9A-Fa-f.:]+?)(?:\]|%5D)?:(\d+)$")


class CallerUnlisted(PermissionDenied):
    """A loopback peer whose connection the kernel's table does not list exactly once."""


def loopback_caller_uid(peer: str, server_port: int, tables: tuple[str, ...] = TCP_TABLES) -> int | None:
    """The uid owning the caller's end of the loopback TCP connection ``peer``
    (a gRPC peer string) has to ``server_port``; None for a peer that is not
    loopback TCP. Raises ``CallerUnlisted`` for a loopback peer whose
    connection is not listed exactly once."""
    m = _PEER.match(peer)
    if m is None:
        return None
    try:
        addr = ipaddress.ip_address(m.group(2))
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if not addr.is_loopback:
        return None
    uids = _uids_of(_proc_forms(addr, int(m.group(3))), server_port, tables)
    if len(uids) != 1:
        raise CallerUnlisted(f"the connection from {peer} to port {server_port} is listed {len(uids)} times in the kernel's TCP "
                             "table, not once: its user is not known, so it may not name shared memory")
    return uids[0]


def _hex_word(word: bytes) -> str:
    """A 32-bit word as /proc/net/tcp* prints it: the host's (little-endian) integer in hex."""
    return f"{int.from_bytes(word, 'little'):08X}"


def _proc_forms(addr: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int) -> set[str]:
    """How the kernel's tables write ``addr:port``: an IPv4 address in ``tcp``,
    and also as IPv4-mapped in ``tcp6`` (an AF_INET6 socket may connect to
    ``::ffff:127.0.0.1``)."""
    if isinstance(addr, ipaddress.IPv4Address):
        v6 = ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + addr.packed)
        forms = {_hex_word(addr.packed), _v6_hex(v6)}
    else:
        forms = {_v6_hex(addr)}
    return {f"{f}:{port:04X}" for f in forms}


def _v6_hex(addr: ipaddress.IPv6Address) -> str:
    return "".join(_hex_word(addr.packed[i:i + 4]) for i in range(0, 16, 4))


def _is_loopback_hex(hex_addr: str) -> bool:
    raw = b"".join(int(hex_addr[i:i + 8], 16).to_bytes(4, "little") for i in range(0, len(hex_addr), 8))
    addr = ipaddress.ip_address(raw)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def _uids_of(local_forms: set[str], remote_port: int, tables: tuple[str, ...]) -> list[int]:
    """The uids of the established sockets whose local end is ``local_forms``
    and whose remote end is ``remote_port`` on a loopback address: seen from
    the caller's socket, its local end is the peer's address, its remote end
    our server (loopback, so both ends are in this network namespace's table)."""
    want_remote = f":{remote_port:04X}"
    uids = []
    for path in tables:
        try:
            with open(path) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            # sl local_address rem_address st tx:rx tr:when retrnsmt uid ...
            fields = line.split()
            if (len(fields) > 7 and fields[3] == ESTABLISHED and fields[1] in local_forms and fields[2].endswith(want_remote)
                    and _is_loopback_hex(fields[2].partition(":")[0])):
                uids.append(int(fields[7]))
    return uids
