"""``host:port`` text, IPv6 too: an IPv6 host is written in brackets
(``[::1]:50051``), as gRPC targets and URLs want it, and kept bare (``::1``)
where a host stands alone (a bind, ``remote_host``)."""

from __future__ import annotations


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
