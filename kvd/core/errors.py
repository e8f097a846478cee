"""Errors that carry a status and name the offending field and value.

The core raises these with its own ``Status``; only the gRPC shell maps a
status to a gRPC code (the names are gRPC's, so the mapping is by name), and
the data plane sends them as ERROR frames. Messages always name the field and
the value, so an operator can act on one line; a long value is quoted as a
short prefix with its length (``quote``), so an error about a huge field
still fits in gRPC's metadata.
"""

from __future__ import annotations

import enum
import sys
from typing import Any


class Status(enum.Enum):
    """What kind of failure: the gRPC status codes kvd uses, by name."""

    INTERNAL = "internal"
    INVALID_ARGUMENT = "invalid_argument"
    FAILED_PRECONDITION = "failed_precondition"
    NOT_FOUND = "not_found"
    PERMISSION_DENIED = "permission_denied"
    UNAUTHENTICATED = "unauthenticated"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAVAILABLE = "unavailable"
    ABORTED = "aborted"
    DEADLINE_EXCEEDED = "deadline_exceeded"


QUOTE_CHARS = 64  # an error names a value, not all of a 1 MiB one


def quote(value: Any) -> str:
    """``repr(value)``, or for a long one a short prefix and its length."""
    text = repr(value)
    if len(text) <= QUOTE_CHARS:
        return text
    size = f"{len(value)} chars" if isinstance(value, (str, bytes)) else f"{len(text)} chars as text"
    return f"{text[:QUOTE_CHARS]}... ({size})"


class KvdError(Exception):
    status: Status = Status.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # A user's subclass that sets ``code`` (the public name since the
        # first release) means its status: keep the two one.
        super().__init_subclass__(**kwargs)
        code = cls.__dict__.get("code")
        if code is not None and not isinstance(code, property):
            cls.status = Status[code.name]
            del cls.code  # type: ignore[misc]

    @property
    def code(self) -> Any:
        """The failure as ``grpc.StatusCode`` (the public API's since the
        first release: ``e.code == grpc.StatusCode.NOT_FOUND``); ``status`` is
        the core's own. Where gRPC is not loaded (a caller of the pure core
        alone), the core's ``Status``. Looked up, not imported: the core
        does not depend on gRPC."""
        grpc = sys.modules.get("grpc")
        return grpc.StatusCode[self.status.name] if grpc is not None else self.status


class InvalidArgument(KvdError):
    """A field of a request is malformed."""

    status = Status.INVALID_ARGUMENT

    def __init__(self, field: str, value: Any, problem: str) -> None:
        super().__init__(f"{field}={quote(value)} {problem}")
        self.field = field
        self.value = value
        self.problem = problem

    def within(self, prefix: str, outer: str) -> InvalidArgument:
        """The same error named from further out: ``prefix`` of its field
        (``spec``) becomes ``outer`` (``groups[2].spec``)."""
        return InvalidArgument(self.field.replace(prefix, outer, 1), self.value, self.problem)


class Incompatible(KvdError):
    """Two engines cannot exchange KV; names both sides' values."""

    status = Status.FAILED_PRECONDITION

    def __init__(self, field: str, local: Any, remote: Any, problem: str = "") -> None:
        msg = f"incompatible {field}: local={quote(local)} remote={quote(remote)}"
        super().__init__(f"{msg}: {problem}" if problem else msg)
        self.field = field


class NotFound(KvdError):
    status = Status.NOT_FOUND


class PermissionDenied(KvdError):
    status = Status.PERMISSION_DENIED


class Unauthenticated(KvdError):
    status = Status.UNAUTHENTICATED


class FailedPrecondition(KvdError):
    status = Status.FAILED_PRECONDITION


class ResourceExhausted(KvdError):
    status = Status.RESOURCE_EXHAUSTED


class Unavailable(KvdError):
    """Transient: the caller may retry."""

    status = Status.UNAVAILABLE


class Aborted(KvdError):
    status = Status.ABORTED


class DeadlineExceeded(KvdError):
    status = Status.DEADLINE_EXCEEDED


_BY_NAME: dict[str, type[KvdError]] = {
    cls.status.name: cls
    for cls in (InvalidArgument, NotFound, PermissionDenied, Unauthenticated, FailedPrecondition,
                ResourceExhausted, Unavailable, Aborted, DeadlineExceeded)
}


def from_code(code_name: str, message: str) -> KvdError:
    """Rebuild an error received from a peer (data plane or gRPC), same class and message."""
    cls = _BY_NAME.get(code_name, KvdError)
    err = cls.__new__(cls)
    KvdError.__init__(err, message)
    return err
