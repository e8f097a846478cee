"""``host:port`` text, IPv6 too: an IPv6 host is written in brackets
(``[::1]:50051``), as gRPC targets and URLs want it, and kept bare (``::1``)
where a host stands alone (a bind, ``remote_host``)."""

from __future__ import annotations

import re

from kvd.core.errors import InvalidArgument

# A host name or IPv4 address, or an IPv6 address in brackets (with a zone, "%eth0").
_HOST = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})|\[[0-9A-Fa-f:.]+(?:%[A-Za-z0-9_.-]+)?\])$")


def bare_host(host: str) -> str:
    """``[::1]`` as ``::1``; any other host as it is."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def host_port(host: str, port: int | str) -> str:
    """``host:port``, the host in brackets where it is IPv6."""
    host = bare_host(host)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_host_port(address: str) -> tuple[str, str]:
    """``host:port`` (``[v6]:port`` too) as the bare host and the port's text."""
    host, _, port = address.rpartition(":")
    return bare_host(host), port


def check_address(field: str, address: str) -> str:
    """A peer's ``host:port`` as it will be dialled: a host name, IPv4, or
    IPv6 in brackets, and a port 1-65535. Refused by name here, not after
    the dial's retries with gRPC's own text."""
    host, sep, port = address.rpartition(":")
    if not sep or not _HOST.match(host) or (":" in host.strip("[]") and not host.startswith("[")):
        raise InvalidArgument(field, address, "must be host:port (IPv6 in brackets: [::1]:50051)")
    if not port.isascii() or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise InvalidArgument(field, address, f"has port {port!r}; must be 1-65535")
    return address
