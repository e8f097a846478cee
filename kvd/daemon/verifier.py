"""End-to-end verification, the daemon's shell around ``core/digest.py``.

The owner (P) digests what each rank published when it publishes, with a
seed of its own the engine never sees, and keeps the digests a while past
the publication's end: a reader asks after its bytes landed, when P may
have let the blocks go. The reader (D) asks for the rows it read, digests
what landed in its own memory with P's seed, and fails exactly the blocks
whose sums differ, so vLLM recomputes them.

A streaming publication is published before its layers are written, and
an opaque group hides its tokens: neither is digested, and a reader's
question about them is answered NOT_FOUND, counted as unverified, as is
every other way a check can fail to be made. A state
part's rows are its blocks' rows (it holds no tokens), split by its own heads.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hmac
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np

from kvd.core.digest import (
    DigestAnswer,
    DigestQuery,
    DigestRows,
    Mismatch,
    RowDigests,
    RowPlan,
    RowSample,
    VerifyMismatch,
    answer,
    compare,
)
from kvd.core.errors import InvalidArgument, NotFound
from kvd.core.leases import DEFAULT_LEASE_SECONDS
from kvd.core.requests import PublishOrder, PullOrder, TransferParams
from kvd.core.spec import GroupSpec, ModelInfo, WorkerId
from kvd.core.topology import HeadSlice, heads_of_rank
from kvd.core.transfer import needed_from
from kvd.daemon.metrics import Metrics
from kvd.daemon.outbound import PeerChannels
from kvd.daemon.registration import Registration

log = logging.getLogger("kvd.daemon")

MODES = ("off", "sampled", "full")
# Bounds on a reader's question: a row's name holds 4096 layers; a state part's rows per block.
MAX_LAYERS, MAX_STATE_ROWS, MAX_SUMS = 4096, 1 << 16, 1 << 24
SAMPLED_PER_WINDOW = 2  # sampled: 2 rows of every 16 tokens, each of a drawn layer and head (32 layers x 8 heads: 1 row in 2048)


def check_mode(field: str, mode: str) -> str:
    if mode not in MODES:
        raise InvalidArgument(field, mode, f"must be one of {', '.join(MODES)}")
    return mode


def group_heads(spec_group: GroupSpec, worker: WorkerId, model: ModelInfo) -> HeadSlice:
    """The global heads a rank holds of a group: the model's KV heads, or a state part's own."""
    spec = spec_group.spec
    return heads_of_rank(worker.tp_rank, worker.tp_size, spec.heads_over_tp(worker.tp_size, model.total_num_kv_heads), spec.use_mla)


def total_heads(spec_group: GroupSpec, worker: WorkerId, model: ModelInfo) -> int:
    """The group's heads over all ranks, which a sample draws from (MLA's latent: one)."""
    spec = spec_group.spec
    return 1 if spec.use_mla else spec.heads_over_tp(worker.tp_size, model.total_num_kv_heads)


def verifiable(group: GroupSpec) -> bool:
    """Groups whose rows kvd can name: not an opaque span (it hides its tokens)."""
    return not group.spec.opaque


def rows_of(group: GroupSpec, ids: Sequence[int], first_token: int, num_tokens: int) -> tuple[list[int], int, int] | None:
    """The blocks, first row and end row a pull lands of ``group`` (as
    ``core.transfer`` plans it): a state part's last block, whole (it holds
    no tokens); else the tokens from ``first_token`` to the request's end or
    its blocks' (None: decode needs none of them, as a chunk past them)."""
    bs = group.spec.block_size
    if group.spec.state:
        return (list(ids[-1:]), 0, bs) if len(ids) else None
    if not len(ids) or needed_from(group, num_tokens, first_token) >= num_tokens:
        return None
    return list(ids), first_token, min(num_tokens, first_token + len(ids) * bs)


@dataclasses.dataclass(frozen=True)
class _Digested:
    """A publication's digests as taken, each rank's by group, and the sample they took."""

    sample: RowSample
    digests: list[list[RowDigests | None]]


@dataclasses.dataclass
class _Taken:
    sample: RowSample
    capability: bytes
    num_tokens: int
    until: float  # kept to the lease's end and verify_keep_seconds past it
    held: dict[tuple[int, int], list[RowDigests | None]] = dataclasses.field(default_factory=dict)
    nbytes: int = 0


class Verifier:
    def __init__(self, mode: str, keep_seconds: float, metrics: Metrics, max_bytes: int = 1 << 30, full_fraction: float = 0.0) -> None:
        self.mode = check_mode("verify", mode)
        self.full_fraction = full_fraction  # of sampled requests, checked whole instead (chosen by the secret: the engine cannot tell which)
        self.keep_seconds = keep_seconds
        self.metrics = metrics
        self.max_bytes = max_bytes
        self._taken: collections.OrderedDict[tuple[str, int], _Taken] = collections.OrderedDict()
        self._bytes = 0
        # A request's seed: keyed by a secret of this daemon's, so every rank's
        # digest of one request agrees and its engine cannot know the rows.
        self._secret = secrets.token_bytes(32)

    # ------------------------------------------------------------ owner

    def _draw(self, label: bytes) -> int:
        """64 bits keyed by this daemon's secret: the same on every rank, unknowable to the engine."""
        return int.from_bytes(hmac.digest(self._secret, label, "sha256")[:8], "little")

    def mode_of(self, order: PublishOrder) -> str:
        """A publication's mode: its own (checked by name) where this daemon
        verifies at all (the operator's choice: off stays off), else this
        daemon's; sampled ones ``full_fraction`` of the time full, by the secret."""
        if order.verify:
            mode = check_mode("verify", order.verify)
            return mode if self.mode != "off" else "off"
        if self.mode == "sampled" and self.full_fraction > 0:
            return "full" if self._draw(b"full:" + order.request_id.encode()) / 2**64 < self.full_fraction else "sampled"
        return self.mode

    def _sample(self, request_id: str, mode: str) -> RowSample:
        """A request's sample: its seed keyed by this daemon's secret, so every rank's digest of it agrees."""
        return RowSample(self._draw(request_id.encode()), 0 if mode == "full" else SAMPLED_PER_WINDOW)

    async def digest(self, regs: Sequence[Registration], order: PublishOrder) -> _Digested | None:
        """Before ``order`` is published (its blocks are final): each rank's
        digests, off the loop (a small sampled one on it: ``_digest_work``). None where verification is off, for a stream
        (published before its layers are written), or where digesting failed
        (logged): the publication goes on, unverified."""
        mode = self.mode_of(order)
        if mode == "off" or order.stream or not regs:
            return None
        sample = self._sample(order.request_id, mode)
        try:
            t = time.perf_counter()
            digests = await _digest_work(sample, order.num_tokens * len(regs) * len(order.block_ids), regs, self._digest_ranks, regs, order, sample)
            self.metrics.verify_digest_seconds.observe(time.perf_counter() - t)
            return _Digested(sample, digests)
        except Exception as e:  # a bad order is the publish's to refuse, by name
            log.warning("not digested request_id=%s: %s: %s", order.request_id, type(e).__name__, e)
            return None

    def keep(self, regs: Sequence[Registration], digested: _Digested | None, params: TransferParams) -> None:
        """Keep what ``digest`` made, now that ``params`` name the publication (on the loop: no await between)."""
        if digested is None:
            return
        digests = digested.digests
        now = time.monotonic()
        key = (params.request_id, params.generation)
        taken = self._taken.get(key)
        if taken is None:
            until = now + (params.lease_seconds or DEFAULT_LEASE_SECONDS) + self.keep_seconds
            taken = self._taken[key] = _Taken(digested.sample, params.capability, params.num_tokens, until)
        for reg, groups in zip(regs, digests, strict=True):
            rank = (reg.worker.tp_rank, reg.worker.pp_rank)
            size = sum(d.nbytes for d in groups if d is not None)
            old = taken.held.get(rank)
            taken.held[rank] = groups
            delta = size - (sum(d.nbytes for d in old if d is not None) if old else 0)
            taken.nbytes += delta
            self._bytes += delta
        self.metrics.verify_digests.inc(len(regs))
        self._expire(now)

    @staticmethod
    def _digest_ranks(regs: Sequence[Registration], order: PublishOrder, sample: RowSample) -> list[list[RowDigests | None]]:
        out = []
        for reg in regs:
            groups: list[RowDigests | None] = []
            for g, tensors, blocks in zip(reg.groups, reg.tensors, order.block_ids, strict=True):
                rows = rows_of(g, blocks.ids, blocks.first_token, order.num_tokens) if verifiable(g) else None
                start = group_heads(g, reg.worker, reg.model).start
                groups.append(RowDigests.of(tensors, g.group_id, rows[0], rows[1], rows[2], start, sample, total_heads(g, reg.worker, reg.model),
                                                            reg.model.num_layers) if rows else None)
            out.append(groups)
        return out

    async def answer(self, query: DigestQuery) -> DigestAnswer:
        """A reader's question, checked against what is held (on the loop),
        summed off it (over a snapshot: the loop may keep more meanwhile)."""
        taken = self._taken.get((query.request_id, query.generation))
        if taken is None or not hmac.compare_digest(taken.capability, query.capability):
            raise NotFound(f"no digest of request_id={query.request_id!r} generation {query.generation} is held "
                           f"(verify={self.mode}; kept to its lease's end and {self.keep_seconds:g}s past it)")
        for i, rows in enumerate(query.rows):
            if len(set(rows.layers)) != len(rows.layers) or len(rows.layers) > MAX_LAYERS:
                raise InvalidArgument(f"rows[{i}].layers", f"<{len(rows.layers)} layers>", f"must be distinct, at most {MAX_LAYERS}")
            if rows.token_stop > max(taken.num_tokens, MAX_STATE_ROWS):
                raise InvalidArgument(f"rows[{i}].token_stop", rows.token_stop, f"is past the publication's {taken.num_tokens} tokens")
            if rows.shape[0] * rows.shape[1] > MAX_SUMS:
                raise InvalidArgument(f"rows[{i}].bin_tokens", rows.bin_tokens, f"makes over {MAX_SUMS} sums; use the reader's block size")
        found = await asyncio.to_thread(answer, query, taken.sample, [taken.held[k] for k in sorted(taken.held)])
        if found is None:
            raise NotFound(f"the digests held of request_id={query.request_id!r} do not cover every row asked "
                           "(a rank that holds them has not published, or a group was not digested)")
        return found

    def _expire(self, now: float) -> None:
        """Drop what is past its time, then the oldest while over ``max_bytes``."""
        for key in [k for k, t in self._taken.items() if t.until <= now]:
            self._bytes -= self._taken.pop(key).nbytes
        while self._bytes > self.max_bytes and len(self._taken) > 1:
            _key, oldest = self._taken.popitem(last=False)
            self._bytes -= oldest.nbytes

    # ------------------------------------------------------------ reader

    def query(self, reg: Registration, params: TransferParams, local: Sequence[Sequence[int]], first_tokens: Sequence[int]) -> DigestQuery | None:
        """What this rank asks of its read (None: no group can be verified)."""
        rows = []
        for g, ids, first in zip(reg.groups, local, first_tokens, strict=True):
            landed = rows_of(g, ids, first, params.num_tokens) if verifiable(g) else None
            if landed is None:
                continue
            heads = group_heads(g, reg.worker, reg.model)
            rows.append(DigestRows(g.group_id, g.layer_indices, range(heads.start, heads.stop), landed[1], landed[2], g.spec.block_size))
        if not rows:
            return None
        return DigestQuery(params.remote_engine_id, params.request_id, params.generation, params.capability, tuple(rows))

    @staticmethod
    def plan(reg: Registration, query: DigestQuery, sample: RowSample, local: Sequence[Sequence[int]],
             first_tokens: Sequence[int]) -> list[_Check]:
        """What checking the read with the owner's ``sample`` takes, all but reading
        what landed (blocking: off the loop unless small, ``_digest_work``)."""
        out = []
        for rows in query.rows:
            g = next(i for i, spec in enumerate(reg.groups) if spec.group_id == rows.group_id)
            ids, first, stop = rows_of(reg.groups[g], local[g], first_tokens[g], rows.token_stop) or ([], 0, 0)
            heads = group_heads(reg.groups[g], reg.worker, reg.model)
            out.append(_Check(rows, list(ids), first, RowPlan.of(reg.tensors[g], rows.group_id, ids, first, stop, heads.start, sample,
                                                                 total_heads(reg.groups[g], reg.worker, reg.model), reg.model.num_layers)))
        return out

    @staticmethod
    def check(checks: Sequence[_Check], theirs: DigestAnswer) -> list[tuple[DigestRows, Mismatch, list[int]]]:
        """Digest what landed as planned and compare (blocking, as ``plan``).
        Per group that differs: its rows, where, and the local block ids to fail."""
        out = []
        for c, sums in zip(checks, theirs.sums, strict=True):
            rows = c.rows
            ours = c.plan.digest().bins(rows.layers, rows.heads, rows.token_start, rows.token_stop, rows.bin_tokens)
            found = compare(rows.layers, ours, np.asarray(sums, dtype=np.uint64).reshape(rows.shape))
            if found is not None:
                first_bin = c.first // rows.bin_tokens
                out.append((rows, found, [int(c.ids[b - first_bin]) for b in found.bins]))
        return out

    def ask_early(self, channels: PeerChannels, reg: Registration, req: PullOrder, params: TransferParams) -> _Asked | None:
        """Ask the owner for its digests as the pull starts (it took them
        before it published), so the answer travels while the bytes do;
        params made before P published are asked once resolved, after landing."""
        if self.mode == "off":
            return None
        local = [list(b.ids) for b in req.local]
        firsts = [b.first_token for b in req.local]
        if not params.generation:  # not resolved yet: its generation, and maybe its blocks, come later
            return _Asked(None, None, local, firsts)
        query = self.query(reg, params, local, firsts)
        if query is None:
            return _Asked(None, None, local, firsts, askable=False)
        task = asyncio.ensure_future(self._answer_and_plan(channels, params.remote_address, reg, query, local, firsts))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # read here: a failed pull may never await it
        return _Asked(query, task, local, firsts)

    async def _answer_and_plan(self, channels: PeerChannels, address: str, reg: Registration, query: DigestQuery,
                               local: list[list[int]], firsts: list[int]) -> tuple[DigestAnswer, list[_Check] | None]:
        """The owner's answer, and for a sample the check's plan, made while
        the bytes travel (a full check's plan holds every row's name: made
        when it is needed, not held through the transfer; a sampled one's, of
        a state group, every row of its last block's state: a few)."""
        theirs = await channels.digest(address, query, timeout=10)
        if not theirs.sample.per_window:
            return theirs, None
        return theirs, await _digest_work(theirs.sample, _positions(query), [reg], self.plan, reg, query, theirs.sample, local, firsts)

    async def verify_landed(self, channels: PeerChannels, reg: Registration, req: PullOrder, params: TransferParams, asked: _Asked) -> None:
        """After a pull landed: take the owner's digests of what was read
        (asked again if the early answer found a rank not yet published) and
        compare; raise ``VerifyMismatch`` naming the local blocks that
        differ. Anything else leaves the load unverified, never failed: the
        bytes landed, and only a digest that differs says they are wrong."""
        t = time.perf_counter()
        try:
            await self._verify_landed(channels, reg, req, params, asked)
        finally:
            self.metrics.pull_phase_seconds.labels("verify").observe(time.perf_counter() - t)

    @staticmethod
    async def _early_answer(asked: _Asked) -> tuple[DigestAnswer | None, list[_Check] | None]:
        """The answer to the question put as the pull started, and its plan;
        None where none was put or it was NOT_FOUND."""
        if asked.task is None:
            return None, None
        try:
            return await asked.task
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise
            return None, None

    async def _verify_landed(self, channels: PeerChannels, reg: Registration, req: PullOrder, params: TransferParams, asked: _Asked) -> None:
        local, firsts = asked.local, asked.firsts
        query = asked.query or (self.query(reg, params, local, firsts) if asked.askable else None)  # ``params`` resolved by now
        if query is None:
            self.metrics.verify_checks.labels("unverified").inc()
            return
        try:
            theirs, checks = await self._early_answer(asked)
            if theirs is None:  # not asked yet, or asked before a rank of the owner published: ask now
                theirs = await channels.digest(params.remote_address, query, timeout=10)
            if checks is None:  # a full check, or an answer asked for after landing
                checks = await _digest_work(theirs.sample, _positions(query), [reg], self.plan, reg, query, theirs.sample, local, firsts)
            found = await _digest_work(theirs.sample, _positions(query), [reg], self.check, checks, theirs)
        except grpc.aio.AioRpcError as e:
            # The owner does not verify, or no longer holds the digests.
            self.metrics.verify_checks.labels("unverified").inc()
            log.info("not verified request_id=%s: %s gave no digest: %s %s", req.request_id, params.remote_engine_id, e.code().name, e.details())
            return
        except Exception as e:  # an answer of another shape (another version), or a digest that could not be taken
            self.metrics.verify_checks.labels("unverified").inc()
            log.warning("not verified request_id=%s: %s: %s", req.request_id, type(e).__name__, e)
            return
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


# A sampled digest of up to this many token positions (summed over ranks and
# groups: 2 rows a 16) runs on the event loop: 0.2-0.7 ms at this size, less
# than the hop to a thread and back costs on a busy host. Larger ones, every
# full one, any of device memory and any with a state group (a state part is
# digested whole, every row, in sampled mode too) go to a thread.
ON_THE_LOOP_TOKENS = 4096
R = TypeVar("R")


def _positions(query: DigestQuery) -> int:
    """The token positions a reader's question covers, over its groups (what ``_digest_work`` sizes)."""
    return sum(r.token_stop - r.token_start for r in query.rows)


async def _digest_work(sample: RowSample, tokens: int, regs: Sequence[Registration], fn: Callable[..., R], *args: Any) -> R:
    """``fn(*args)``, a digest of ``tokens`` positions of ``regs``: on the loop where it is small, else on a thread."""
    small = sample.per_window and tokens <= ON_THE_LOOP_TOKENS and not any(g.spec.state for reg in regs for g in reg.groups)
    if small and all(t.device.type == "cpu" for reg in regs for t in reg.tensors):
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


@dataclasses.dataclass
class _Asked:
    """A reader's question, put as its pull started, and the answer on its way."""

    query: DigestQuery | None  # None: no group of the read can be verified
    task: asyncio.Future[tuple[DigestAnswer, list[_Check] | None]] | None
    local: list[list[int]]
    firsts: list[int]
    askable: bool = True  # False: no group of the read can be verified

    def cancel(self) -> None:
        """The pull failed: its answer is not wanted."""
        if self.task is not None:
            self.task.cancel()


@dataclasses.dataclass(frozen=True)
class _Check:
    """One asked group's check, planned: its rows, the local blocks (from
    the one holding ``first``) a mismatch fails, and the digest's plan."""

    rows: DigestRows
    ids: list[int]
    first: int
    plan: RowPlan
