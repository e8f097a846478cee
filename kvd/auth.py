"""Authentication and secrets (see docs/security.md for the threat model).

Modes (config ``auth``):

* ``none``: no authentication (loopback development only).
* ``token``: a shared bearer token, read from ``token_file``. gRPC calls carry
  ``authorization: Bearer <token>``; data-plane HELLOs carry it too.
* ``mtls``: gRPC over TLS with client certificates required
  (``tls_cert_file``, ``tls_key_file``, ``tls_ca_file``). The data plane is
  authenticated by a per-reader secret that the owner issues in the
  handshake answer, i.e. over the mutually authenticated channel.

Secrets are read from files whose permissions are checked, compared in
constant time, and never logged.
"""

from __future__ import annotations

import hmac
import os
import ssl
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from kvd.core.errors import InvalidArgument

TOKEN_HEADER = "authorization"
WORKER_TOKEN_HEADER = "kvd-worker-token"
# Health must stay reachable by kubelet probes, which cannot present a token.
UNAUTHENTICATED_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})


def read_secret(path: str, field: str) -> bytes:
    """A secret file: a regular file, not readable by group or others."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise InvalidArgument(field, path, f"cannot be opened: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgument(field, path, "is not a regular file")
        if st.st_mode & 0o077:
            raise InvalidArgument(field, path, f"has mode {oct(st.st_mode & 0o777)}; secrets must not be readable by group or others (chmod 600)")
        data = os.read(fd, 1 << 20)
    finally:
        os.close(fd)
    secret = data.strip()
    if len(secret) < 16:
        raise InvalidArgument(field, path, "holds fewer than 16 bytes; use a long random token")
    return secret


def same_secret(a: bytes | str, b: bytes | str) -> bool:
    """Constant-time comparison."""
    a_ = a.encode() if isinstance(a, str) else a
    b_ = b.encode() if isinstance(b, str) else b
    return hmac.compare_digest(a_, b_)


@dataclass(frozen=True)
class AuthConfig:
    mode: str = "none"  # none | token | mtls
    token: bytes = b""
    cert_chain: bytes = b""
    private_key: bytes = b""
    root_certs: bytes = b""
    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""

    def __repr__(self) -> str:  # never print secrets
        return f"AuthConfig(mode={self.mode!r})"

    @classmethod
    def load(cls, mode: str, token_file: str = "", cert_file: str = "", key_file: str = "", ca_file: str = "") -> AuthConfig:
        if mode == "none":
            return cls()
        if mode == "token":
            if not token_file:
                raise InvalidArgument("token_file", token_file, "is required with auth=token")
            return cls(mode, token=read_secret(token_file, "token_file"))
        if mode == "mtls":
            for name, value in (("tls_cert_file", cert_file), ("tls_key_file", key_file), ("tls_ca_file", ca_file)):
                if not value:
                    raise InvalidArgument(name, value, "is required with auth=mtls")
            with open(cert_file, "rb") as f:
                cert = f.read()
            with open(ca_file, "rb") as f:
                ca = f.read()
            return cls(mode, cert_chain=cert, private_key=read_secret(key_file, "tls_key_file"), root_certs=ca,
                       cert_file=cert_file, key_file=key_file, ca_file=ca_file)
        raise InvalidArgument("auth", mode, "must be none, token or mtls")

    # ---------------------------------------------------------------- gRPC

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if self.mode != "mtls":
            return None
        return grpc.ssl_server_credentials([(self.private_key, self.cert_chain)], root_certificates=self.root_certs, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if self.mode != "mtls":
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.root_certs, private_key=self.private_key, certificate_chain=self.cert_chain)

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        if self.mode == "token":
            return ((TOKEN_HEADER, f"Bearer {self.token.decode()}"),)
        return ()

    def aio_channel(self, address: str) -> grpc.aio.Channel:
        # A peer that was down is retried within seconds of coming back:
        # gRPC's default backoff grows to 120 s, and finished-set reports
        # to an aggregator daemon would wait that long.
        options = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 5000)]
        creds = self.channel_credentials()
        if creds is not None:
            return grpc.aio.secure_channel(address, creds, options=options)
        return grpc.aio.insecure_channel(address, options=options)

    def data_plane_context(self, server: bool) -> ssl.SSLContext | None:
        """mTLS on the data plane: both sides present a certificate from the CA.

        Peers are identified by the CA, not by hostname (pod IPs change), so
        hostname checking is off and a certificate is always required.
        """
        if self.mode != "mtls":
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH if server else ssl.Purpose.SERVER_AUTH, cafile=self.ca_file)
        ctx.load_cert_chain(self.cert_file, self.key_file)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        return ctx

    def check_hello_token(self, presented: bytes) -> bool:
        """Data plane, token mode: the HELLO's token."""
        return self.mode != "token" or same_secret(presented, self.token)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for every call without the bearer token (health excepted)."""

    def __init__(self, token: bytes) -> None:
        self._expected = b"Bearer " + token

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)

        async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
            yield  # pragma: no cover

        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny_stream)

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]], details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        if details.method in UNAUTHENTICATED_METHODS:
            return await continuation(details)
        for key, value in details.invocation_metadata or ():
            if key == TOKEN_HEADER and same_secret(value if isinstance(value, bytes) else value.encode(), self._expected):
                return await continuation(details)
        return self._deny_stream if details.method.endswith("WatchEngineFinished") else self._deny_unary


def is_local_peer(peer: str) -> bool:
    """A gRPC peer string for loopback or a Unix socket."""
    return peer.startswith(("unix:", "ipv4:127.", "ipv6:[::1]", "ipv6:%5B::1%5D"))
