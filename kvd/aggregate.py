"""Finished sets per worker, and their merge per engine (pure).

Semantics follow vLLM's ``KVConnectorBase_V1.get_finished`` and
``KVOutputAggregator``: a worker reports request ids whose sends and receives
have ended; an engine-level aggregator emits a request once
``expected_finished_count`` workers (the world size by default) have reported
it; invalid block ids are unioned.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Outcome:
    request_id: str
    direction: str  # sending | recving
    outcome: str  # done | failed | expired | aborted
    reason: str = ""
    bytes: int = 0


@dataclass
class WorkerFinished:
    """What one worker has not yet been told."""

    sending: dict[str, Outcome] = field(default_factory=dict)
    recving: dict[str, Outcome] = field(default_factory=dict)
    invalid_block_ids: set[int] = field(default_factory=set)

    def add(self, outcome: Outcome, invalid_block_ids: Iterable[int] = ()) -> None:
        (self.sending if outcome.direction == "sending" else self.recving)[outcome.request_id] = outcome
        self.invalid_block_ids.update(invalid_block_ids)

    def drain(self) -> WorkerFinished:
        out = WorkerFinished(self.sending, self.recving, self.invalid_block_ids)
        self.sending, self.recving, self.invalid_block_ids = {}, {}, set()
        return out


class KVOutputAggregator:
    """Merge per-worker finished sets into an engine's, like vLLM's aggregator."""

    def __init__(self, expected_finished_count: int) -> None:
        if expected_finished_count < 1:
            raise ValueError("expected_finished_count must be >= 1")
        self.expected = expected_finished_count
        # (direction, request_id) -> (workers reported so far, worst outcome so far)
        self._pending: dict[tuple[str, str], tuple[int, Outcome]] = {}

    def aggregate(self, outputs: Iterable[WorkerFinished]) -> WorkerFinished:
        merged = WorkerFinished()
        for out in outputs:
            merged.invalid_block_ids |= out.invalid_block_ids
            for outcome in (*out.sending.values(), *out.recving.values()):
                key = (outcome.direction, outcome.request_id)
                count, worst = self._pending.get(key, (0, outcome))
                # One failed worker fails the request for the whole engine.
                if worst.outcome == "done" and outcome.outcome != "done":
                    worst = outcome
                count += 1
                if count >= self.expected:
                    self._pending.pop(key, None)
                    merged.add(worst)
                else:
                    self._pending[key] = (count, worst)
        return merged
