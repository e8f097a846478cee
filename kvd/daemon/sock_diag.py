"""The kernel's TCP sockets on one port, read in one pass (netlink sock_diag).

``/proc/net/tcp`` is not a snapshot: it is read 4 KiB at a time, and each
read resumes by counting sockets into a hash bucket, so while connections
come and go one socket can be listed twice (27 times in one read, measured)
or skipped (a real worker was refused for a repeat). A sock_diag dump with
a filter walks the table once in the kernel (each bucket under its lock) and
returns the matching sockets in one reply: a socket that exists for the whole
dump is listed exactly once. It is also what ``ss`` reads. (Past about 200
matching sockets the reply spans reads, each resuming by position within a
bucket, as /proc does at every page: a daemon's port holds tens. A miss or a
repeat there refuses a caller; it lets none through, since a twin's end on
our side is ours, and one not listed reads as reset.)

The filter is the kernel's own bytecode (``inet_diag_bc_op``): local port
``port``, or local port ``other`` towards remote port ``port``. TIME_WAIT
sockets are left out by the state mask: ended connections, held by no
process. The kernel tests the mask against a timewait socket's substate, so
an orphan in FIN_WAIT2 (a timewait socket too) is listed, as FIN_WAIT2 with
inode 0, as /proc showed it.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from dataclasses import dataclass

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
INET_DIAG_REQ_BYTECODE = 1
BC_JMP, BC_S_EQ, BC_D_EQ = 1, 11, 12
ESTABLISHED, TIME_WAIT, LISTEN = 1, 6, 10
LIVE_STATES = 0x1FFE & ~(1 << TIME_WAIT)  # TCP_ESTABLISHED (1) .. TCP_NEW_SYN_RECV (12)

_HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, seq, pid
_OP = struct.Struct("=BBH")  # inet_diag_bc_op: code, yes, no (jumps in bytes from this op)
_MSG_HEAD = struct.Struct("=BBBB")  # inet_diag_msg: family, state, timer, retransmits
_PORTS = struct.Struct("!HH")  # its sockid: source and destination port, in network order
_MSG_REST = struct.Struct("=16s16sI8sIIIII")  # addresses, interface, cookie, expires, queues, uid, inode
_RECV = 1 << 20

Address = tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]


@dataclass(frozen=True)
class TcpSocket:
    """One TCP socket in this network namespace (inode 0: no process holds it; uid then 0)."""

    local: Address
    remote: Address
    state: int  # the kernel's TCP_* number
    uid: int
    inode: int


def unmapped(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """``::ffff:a.b.c.d`` as ``a.b.c.d``: one address, however a socket wrote it."""
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def port_filter(port: int, other: int) -> bytes:
    """Bytecode: local port ``port``, or (local port ``other`` and remote port ``port``).
    A failing comparison jumps 4 bytes past the end (no match), a matching one to the next
    test; the JMP after the first match skips the rest (to the end: a match). The kernel
    audits the chain of ``yes`` jumps, so every op is on it."""
    def port_op(code: int, value: int, no: int) -> bytes:
        return _OP.pack(code, 8, no) + _OP.pack(0, 0, value)
    return (port_op(BC_S_EQ, port, 12)  # no: to the second test, after the JMP
            + _OP.pack(BC_JMP, 4, 20)  # matched: to the end (28)
            + port_op(BC_S_EQ, other, 20)  # no: the end + 4
            + port_op(BC_D_EQ, port, 12))


def tcp_sockets(port: int, other: int) -> list[TcpSocket]:
    """Every live TCP socket (not TIME_WAIT) with local ``port``, or with local ``other`` towards
    remote ``port``, IPv4 and IPv6. Raises OSError where the kernel has no sock_diag."""
    found: list[TcpSocket] = []
    bytecode = port_filter(port, other)
    for family in (socket.AF_INET, socket.AF_INET6):
        found += _dump(family, bytecode)
    return found


def _dump(family: int, bytecode: bytes) -> list[TcpSocket]:
    request = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, LIVE_STATES) + bytes(48)  # the sockid is unused by a dump
    attribute = struct.pack("=HH", 4 + len(bytecode), INET_DIAG_REQ_BYTECODE) + bytecode
    body = request + attribute
    message = _HEADER.pack(_HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, 0) + body
    found: list[TcpSocket] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as nl:
        nl.sendall(message)
        while True:
            data = nl.recv(_RECV)
            if not data:
                raise OSError("sock_diag: the dump ended without NLMSG_DONE")
            offset = 0
            while offset + _HEADER.size <= len(data):
                length, kind, _, _, _ = _HEADER.unpack_from(data, offset)
                if length < _HEADER.size:
                    raise OSError(f"sock_diag: a message of {length} bytes")
                # Both carry an error number after the header: NLMSG_DONE's is nonzero for a dump
                # that failed part way (and may be absent), NLMSG_ERROR's for a refused request.
                errno = -struct.unpack_from("=i", data, offset + _HEADER.size)[0] if length >= _HEADER.size + 4 else 0
                if kind == NLMSG_ERROR or (kind == NLMSG_DONE and errno):
                    raise OSError(errno, f"sock_diag: {os.strerror(errno)}")
                if kind == NLMSG_DONE:
                    return found
                if kind == SOCK_DIAG_BY_FAMILY:
                    found.append(_socket(data, offset + _HEADER.size))
                offset += (length + 3) & ~3


def _socket(data: bytes, at: int) -> TcpSocket:
    family, state, _, _ = _MSG_HEAD.unpack_from(data, at)
    sport, dport = _PORTS.unpack_from(data, at + _MSG_HEAD.size)
    src, dst, _, _, _, _, _, uid, inode = _MSG_REST.unpack_from(data, at + _MSG_HEAD.size + _PORTS.size)
    size = 4 if family == socket.AF_INET else 16
    return TcpSocket((unmapped(ipaddress.ip_address(src[:size])), sport), (unmapped(ipaddress.ip_address(dst[:size])), dport),
                     state, uid, inode)
