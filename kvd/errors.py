"""Errors that carry a gRPC status and name the offending field and value.

The core raises these; the gRPC shell maps them to statuses unchanged, and the
data plane sends them as DataError frames. Messages always name the field and
the value, so an operator can act on one line.
"""

from __future__ import annotations

from typing import Any

import grpc


class KvdError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(KvdError):
    """A field of a request is malformed."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, value: Any, problem: str) -> None:
        super().__init__(f"{field}={value!r} {problem}")
        self.field = field
        self.value = value


class Incompatible(KvdError):
    """Two engines cannot exchange KV; names both sides' values."""

    code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, field: str, local: Any, remote: Any, problem: str = "") -> None:
        msg = f"incompatible {field}: local={local!r} remote={remote!r}"
        super().__init__(f"{msg}: {problem}" if problem else msg)
        self.field = field


class NotFound(KvdError):
    code = grpc.StatusCode.NOT_FOUND


class PermissionDenied(KvdError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unauthenticated(KvdError):
    code = grpc.StatusCode.UNAUTHENTICATED


class FailedPrecondition(KvdError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(KvdError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(KvdError):
    """Transient: the caller may retry."""

    code = grpc.StatusCode.UNAVAILABLE


class Aborted(KvdError):
    code = grpc.StatusCode.ABORTED


class DeadlineExceeded(KvdError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


_BY_NAME: dict[str, type[KvdError]] = {
    cls.code.name: cls
    for cls in (InvalidArgument, NotFound, PermissionDenied, Unauthenticated, FailedPrecondition,
                ResourceExhausted, Unavailable, Aborted, DeadlineExceeded)
}


def from_code(code_name: str, message: str) -> KvdError:
    """Rebuild an error received from a peer (data plane or gRPC), same class and message."""
    cls = _BY_NAME.get(code_name, KvdError)
    err = cls.__new__(cls)
    KvdError.__init__(err, message)
    return err
