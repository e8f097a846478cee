"""A pull as D's daemon holds it while it runs (its request, task, progress
and why it was cancelled), and a failed one as it is remembered for
``Admin.Status``."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from kvd.core.digest import VerifyMismatch
from kvd.core.errors import KvdError
from kvd.core.pull import PullProgress
from kvd.core.qos import QosTag
from kvd.core.requests import PullOrder, TransferParams
from kvd.core.spec import WorkerId


@dataclass
class ActivePull:
    """A pull queued or in flight, kept alive on P by heartbeat."""

    worker: WorkerId
    request: PullOrder
    # The request's params, once resolved where they were made before P published.
    params: TransferParams
    started: float
    task: asyncio.Task[None] | None = None
    next_renew: float = 0.0
    lease_gone: bool = False  # a renewal found P's publication ended: not renewed again, and nothing to tell P
    cancel_reason: str = ""  # why we cancelled it ourselves
    cancel_outcome: str = "failed"  # "aborted" when the local worker asked
    accepted: float = 0.0  # perf_counter at Pull: the queued phase starts here
    progress: PullProgress = field(default_factory=PullProgress)  # what has landed: Admin.Status shows it
    qos: QosTag = field(default_factory=QosTag)  # its place on a contended wire
    gave_up: str = ""  # why it won't read the rest: P is told once no sibling rank still reads
    ran: bool = False  # its task took its first step (one cancelled before never reports)
    resolving: asyncio.Task[None] | None = None  # params made before P published, resolved while it queues

    def cancel(self, reason: str, outcome: str = "failed") -> None:
        if self.task is not None and not self.task.done():
            self.cancel_reason, self.cancel_outcome = reason, outcome
            self.task.cancel()


@dataclass(frozen=True)
class Failure:
    request_id: str
    reason: str
    message: str
    at: float


def failure_reason(e: BaseException) -> tuple[str, str]:
    if isinstance(e, asyncio.CancelledError):
        return "aborted", "pull aborted"
    if isinstance(e, asyncio.TimeoutError):
        return "timeout", "pull timed out"
    if isinstance(e, VerifyMismatch):
        return "verify_mismatch", e.message
    if isinstance(e, KvdError):
        return e.status.name.lower(), e.message
    if isinstance(e, (ConnectionError, OSError)):
        return "connection", f"{type(e).__name__}: {e}"
    return "internal", f"{type(e).__name__}: {e}"
