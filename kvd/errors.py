"""kvd's errors, for users of the client: ``kvd.core.errors`` is their home."""

from kvd.core.errors import (
    Aborted,
    DeadlineExceeded,
    FailedPrecondition,
    Incompatible,
    InvalidArgument,
    KvdError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Status,
    Unauthenticated,
    Unavailable,
    from_code,
)

__all__ = [
    "Aborted", "DeadlineExceeded", "FailedPrecondition", "Incompatible", "InvalidArgument", "KvdError", "NotFound",
    "PermissionDenied", "ResourceExhausted", "Status", "Unauthenticated", "Unavailable", "from_code",
]
