"""End-to-end verification, the daemon's shell around ``core/digest.py``.

The owner (P) digests what each rank published when it publishes, with a
seed of its own the engine never sees, and keeps the digests a while past
the publication's end: a reader asks after its bytes landed, when P may
have let the blocks go. The reader (D) asks for the rows it read, digests
what landed in its own memory with P's seed, and fails exactly the blocks
whose sums differ, so vLLM recomputes them.

A streaming publication is published before its layers are written, and
an opaque group hides its tokens: neither is digested, and a reader's
question about them is answered NOT_FOUND, counted as unverified. A state
part's rows are its blocks' rows (it holds no tokens), split by its own heads.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import secrets
import time
from collections.abc import Sequence

import grpc
import numpy as np

from kvd.core.digest import (
    DigestAnswer,
    DigestQuery,
    DigestRows,
    Mismatch,
    RowDigests,
    RowSample,
    VerifyMismatch,
    answer,
    compare,
)
from kvd.core.errors import InvalidArgument, NotFound
from kvd.core.requests import PublishOrder, PullOrder, TransferParams
from kvd.core.spec import GroupSpec, ModelInfo, WorkerId
from kvd.core.topology import HeadSlice, heads_of_rank
from kvd.daemon.metrics import Metrics
from kvd.daemon.outbound import PeerChannels
from kvd.daemon.registration import Registration

log = logging.getLogger("kvd.daemon")

MODES = ("off", "sampled", "full")
SAMPLED_PER_WINDOW = 2  # sampled: 2 tokens of every 16 (an eighth of the rows), every layer and head of each


def check_mode(field: str, mode: str) -> str:
    if mode not in MODES:
        raise InvalidArgument(field, mode, f"must be one of {', '.join(MODES)}")
    return mode


def group_heads(spec_group: GroupSpec, worker: WorkerId, model: ModelInfo) -> HeadSlice:
    """The global heads a rank holds of a group: the model's KV heads, or a state part's own."""
    spec = spec_group.spec
    total = (spec.total_heads or spec.num_kv_heads * worker.tp_size) if spec.state else model.total_num_kv_heads
    return heads_of_rank(worker.tp_rank, worker.tp_size, total, spec.use_mla)


def verifiable(group: GroupSpec) -> bool:
    """Groups whose rows kvd can name: not an opaque span (it hides its tokens)."""
    return not group.spec.opaque


def rows_stop(group: GroupSpec, first_token: int, num_ids: int, num_tokens: int) -> int:
    """Where a group's digested rows end: the request's tokens, or every row of a state part's blocks (it holds no tokens)."""
    end = first_token + num_ids * group.spec.block_size
    return end if group.spec.state else min(num_tokens, end)


@dataclasses.dataclass
class _Taken:
    sample: RowSample
    capability: bytes
    at: float
    held: dict[tuple[int, int], list[RowDigests | None]] = dataclasses.field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(d.nbytes for groups in self.held.values() for d in groups if d is not None)


class Verifier:
    def __init__(self, mode: str, keep_seconds: float, metrics: Metrics, max_bytes: int = 256 << 20) -> None:
        self.mode = check_mode("verify", mode)
        self.keep_seconds = keep_seconds
        self.metrics = metrics
        self.max_bytes = max_bytes
        self._taken: collections.OrderedDict[tuple[str, int], _Taken] = collections.OrderedDict()
        self._bytes = 0

    # ------------------------------------------------------------ owner

    async def take(self, regs: Sequence[Registration], order: PublishOrder, params: TransferParams) -> None:
        """Digest what ``regs`` just published (off the loop); kept for readers to ask."""
        if self.mode == "off" or params.stream:
            return
        now = time.monotonic()
        self._expire(now)
        key = (params.request_id, params.generation)
        taken = self._taken.get(key)
        if taken is None:
            sample = RowSample(secrets.randbits(64), 0 if self.mode == "full" else SAMPLED_PER_WINDOW)
            taken = self._taken[key] = _Taken(sample, params.capability, now)
        digests = await asyncio.to_thread(self._digest_ranks, regs, order, taken.sample)
        for reg, groups in zip(regs, digests, strict=True):
            taken.held[(reg.worker.tp_rank, reg.worker.pp_rank)] = groups
            self._bytes += sum(d.nbytes for d in groups if d is not None)
        self.metrics.verify_digests.inc(len(regs))

    @staticmethod
    def _digest_ranks(regs: Sequence[Registration], order: PublishOrder, sample: RowSample) -> list[list[RowDigests | None]]:
        out = []
        for reg in regs:
            groups: list[RowDigests | None] = []
            for g, tensors, blocks in zip(reg.groups, reg.tensors, order.block_ids, strict=True):
                start = group_heads(g, reg.worker, reg.model).start
                stop = rows_stop(g, blocks.first_token, len(blocks.ids), order.num_tokens)
                groups.append(RowDigests.of(tensors, g.group_id, blocks.ids, blocks.first_token, stop, start, sample) if verifiable(g) else None)
            out.append(groups)
        return out

    def answer(self, query: DigestQuery) -> DigestAnswer:
        self._expire(time.monotonic())
        taken = self._taken.get((query.request_id, query.generation))
        if taken is None or taken.capability != query.capability:
            raise NotFound(f"no digest of request_id={query.request_id!r} generation {query.generation} is held "
                           f"(verify={self.mode}, kept {self.keep_seconds:g}s past publication)")
        for rows in query.rows:
            if any(rows.group_id >= len(groups) or groups[rows.group_id] is None for groups in taken.held.values()):
                raise NotFound(f"group {rows.group_id} of request_id={query.request_id!r} was not digested (opaque or state part)")
        return answer(query, taken.sample, [taken.held[k] for k in sorted(taken.held)])

    def _expire(self, now: float) -> None:
        while self._taken:
            key, oldest = next(iter(self._taken.items()))
            if now - oldest.at < self.keep_seconds and self._bytes <= self.max_bytes:
                break
            self._bytes -= oldest.nbytes
            del self._taken[key]

    # ------------------------------------------------------------ reader

    def query(self, reg: Registration, params: TransferParams, local: Sequence[Sequence[int]], first_tokens: Sequence[int]) -> DigestQuery | None:
        """What this rank asks of its read (None: no group can be verified)."""
        rows = []
        for g, ids, first in zip(reg.groups, local, first_tokens, strict=True):
            if not verifiable(g) or not len(ids):
                continue
            heads = group_heads(g, reg.worker, reg.model)
            stop = rows_stop(g, first, len(ids), params.num_tokens)
            rows.append(DigestRows(g.group_id, g.layer_indices, range(heads.start, heads.stop), first, stop, g.spec.block_size))
        if not rows:
            return None
        return DigestQuery(params.remote_engine_id, params.request_id, params.generation, params.capability, tuple(rows))

    @staticmethod
    def check(reg: Registration, query: DigestQuery, theirs: DigestAnswer, local: Sequence[Sequence[int]],
              first_tokens: Sequence[int]) -> list[tuple[DigestRows, Mismatch, list[int]]]:
        """Digest what landed with the owner's sample and compare (blocking: run off the loop).
        Per group that differs: its rows, where, and the local block ids to fail."""
        out = []
        for rows, sums in zip(query.rows, theirs.sums, strict=True):
            g = next(i for i, spec in enumerate(reg.groups) if spec.group_id == rows.group_id)
            heads = group_heads(reg.groups[g], reg.worker, reg.model)
            mine = RowDigests.of(reg.tensors[g], rows.group_id, local[g], first_tokens[g], rows.token_stop, heads.start, theirs.sample)
            ours = mine.bins(rows.layers, rows.heads, rows.token_start, rows.token_stop, rows.bin_tokens)
            found = compare(rows.layers, ours, np.asarray(sums, dtype=np.uint64).reshape(rows.shape))
            if found is not None:
                first_bin = first_tokens[g] // rows.bin_tokens
                out.append((rows, found, [int(local[g][b - first_bin]) for b in found.bins]))
        return out

    async def verify_landed(self, channels: PeerChannels, reg: Registration, req: PullOrder, params: TransferParams) -> None:
        """After a pull landed: ask its owner for the digests of what was read
        and compare; raise ``VerifyMismatch`` naming the local blocks that differ."""
        local = [list(b.ids) for b in req.local]
        firsts = [b.first_token for b in req.local]
        query = self.query(reg, params, local, firsts)
        if query is None:
            self.metrics.verify_checks.labels("unverified").inc()
            return
        try:
            theirs = await channels.digest(params.remote_address, query, timeout=10)
        except grpc.aio.AioRpcError as e:
            # Not a failure of the pull: the owner does not verify, or no longer holds the digests.
            self.metrics.verify_checks.labels("unverified").inc()
            log.info("not verified request_id=%s: %s gave no digest: %s %s", req.request_id, params.remote_engine_id, e.code().name, e.details())
            return
        found = await asyncio.to_thread(self.check, reg, query, theirs, local, firsts)
        if not found:
            self.metrics.verify_checks.labels("ok").inc()
            return
        invalid = [b for _rows, _m, ids in found for b in ids]
        self.metrics.verify_checks.labels("mismatch").inc()
        self.metrics.verify_mismatches.inc(len(invalid))
        rows, m, ids = found[0]
        raise VerifyMismatch(
            f"what landed differs from what {params.remote_engine_id!r} published ({theirs.sample.describe()}): "
            f"group {rows.group_id}, first at layer {m.first_layer} in tokens [{m.first_bin * rows.bin_tokens}, "
            f"{(m.first_bin + 1) * rows.bin_tokens}) (local block {ids[0]}); {len(invalid)} local blocks failed", invalid)
