"""KvdConnector's scheduler side: which requests publish, load or release
what, decided from vLLM's block tables and ``kv_transfer_params``.

It runs in vLLM's scheduler process; what it decides reaches the workers as
``KvdConnectorMetadata`` on the next engine step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.kv_cache_interface import MambaSpec
from vllm.v1.request import RequestStatus

from kvd.client import KvdClient, daemon_status
from kvd.convert import params_from_pb
from kvd.core.requests import TransferParams
from kvd.errors import FailedPrecondition, KvdError, PermissionDenied
from kvd.integrations.kv_params import (
    GroupBlocks,
    LoadRequest,
    Publication,
    check_params,
    group_blocks,
    is_kvd_load,
    load_request,
    make_params,
    publish_asked,
    release_params,
)
from kvd.integrations.vllm_caches import group_parts
from kvd.integrations.vllm_clock import ForwardClock
from kvd.integrations.vllm_settings import Settings
from kvd.spec import WorkerId

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvd")

T = TypeVar("T")

# How long the scheduler's publish may take before the workers publish
# instead: a local call that takes well under a millisecond when all is well.
PUBLISH_TIMEOUT_S = 5.0
# Refusals in a row (FAILED_PRECONDITION) after which the scheduler pauses
# publishing for the engine: one may be the request's own (published twice).
ENGINE_REFUSALS_TO_PAUSE = 3
# How long it pauses for, before it tries again: a worker that registered
# again with a restarted daemon keeps its token, and the scheduler's is good again.
ENGINE_RETRY_S = 10.0

# Steps after the forward clock is made by which every rank on this host has
# mapped it (each does in its first step that names it): its name goes then.
CLOCK_OPEN_STEPS = 64

_PREFILL_DONE = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


@dataclass
class KvdConnectorMetadata(KVConnectorMetadata):
    """One step's instructions from the scheduler to every worker."""

    to_publish: dict[str, Publication] = field(default_factory=dict)
    to_load: dict[str, LoadRequest] = field(default_factory=dict)
    # Loads claimed but impossible: the worker reports them failed, with their blocks.
    failed_loads: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # Publications D will not read (it holds the whole prompt already): P may free them now.
    to_release: dict[str, TransferParams] = field(default_factory=dict)
    # Streamed publications whose request ended before D read them, by request id: their name, and whether
    # vLLM holds the blocks for their finished_sending (aborted) or freed them itself (preempted).
    to_end: dict[str, tuple[str, bool]] = field(default_factory=dict)
    # The step computes no token: vLLM steps anyway while it holds requests
    # for transfers, and the workers may wait for the daemon's news instead.
    idle: bool = False
    # The step's number, and the file its workers stamp when its forward ends (vllm_clock).
    step: int = 0
    clock: str = ""


def _group_block_sizes(vllm_config: VllmConfig, kv_cache_config: Any) -> list[int]:
    """Tokens per block of each KV cache group, in vLLM's group order."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if groups:
        return [int(g.kv_cache_spec.block_size) for g in groups]
    return [int(vllm_config.cache_config.block_size)]


def _loadable(blocks: Any, block_size: int) -> GroupBlocks:
    """D's blocks of one group that a load fills: neither in its own prefix
    cache (hashed) nor null (before a window); they run to the end."""
    kept = [(i, b.block_id) for i, b in enumerate(blocks) if b.block_hash is None and not b.is_null]
    if not kept:
        return GroupBlocks(len(blocks) * block_size, ())
    if [i for i, _ in kept] != list(range(kept[0][0], kept[0][0] + len(kept))):
        raise KvdError(f"blocks to load are not one run: positions {[i for i, _ in kept][:8]}")
    return GroupBlocks(kept[0][0] * block_size, tuple(b for _, b in kept))


def _computes_rest_of_prompt(request: Request, scheduler_output: Any) -> bool:
    """This step computes the rest of ``request``'s prompt (asked before vLLM advances its computed tokens)."""
    scheduled = int(scheduler_output.num_scheduled_tokens.get(request.request_id, 0))
    return bool(scheduled) and request.num_computed_tokens + scheduled >= request.num_prompt_tokens


def _state_block(ids: Any, scratch: int) -> GroupBlocks:
    """A state group's running state: its last real block, before the
    speculative scratch blocks (NIXL's ``clip_ssm_state_blocks`` alike)."""
    real = [int(getattr(b, "block_id", b)) for b in ids if not getattr(b, "is_null", False) and int(getattr(b, "block_id", b)) != 0]
    real = real[: len(real) - scratch] if scratch else real
    return GroupBlocks(0, tuple(real[-1:]))


class SchedulerSide:
    def __init__(self, vllm_config: VllmConfig, settings: Settings, kv_cache_config: Any = None) -> None:
        self.settings = settings
        self.block_size = int(vllm_config.cache_config.block_size)
        self.block_sizes = _group_block_sizes(vllm_config, kv_cache_config)
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        # A state group (Mamba, linear attention) moves as several kvd groups, one per state part.
        self.parts = group_parts(kv_cache_config, self.tp_size)
        specs = [g.kv_cache_spec for g in getattr(kv_cache_config, "kv_cache_groups", None) or ()]
        self.scratch = [int(getattr(sp, "num_speculative_blocks", 0) or 0) for sp in specs] or [0]
        self.state = [isinstance(sp, MambaSpec) for sp in specs] or [False]
        self.pp_size = int(vllm_config.parallel_config.pipeline_parallel_size)
        self._engine_id = ""
        # Publishes a finished request for every rank at once (PublishEngine),
        # once the workers' tokens came through vLLM's connector handshake.
        self._engine_client: KvdClient | None = None
        self._engine_refusals = 0  # in a row
        self._engine_paused_until = 0.0  # monotonic: refused until then, the workers publish
        self._to_publish: dict[str, Publication] = {}
        self._to_load: dict[str, LoadRequest] = {}
        self._failed_loads: dict[str, tuple[int, ...]] = {}
        self._to_release: dict[str, TransferParams] = {}
        self._to_end: dict[str, tuple[str, bool]] = {}
        # Layer-wise streaming on P: requests to stream whose prompt's last
        # step has not come yet (with vLLM's own live block lists), and those
        # published to stream (by request id, their publication's name).
        self._stream_pending: dict[str, tuple[Request, KVCacheBlocks]] = {}
        self._streamed: dict[str, tuple[str, Request]] = {}
        # Dual-batch overlap saves a layer once per micro-batch: the first save would claim the layer too early.
        self.can_stream = not bool(getattr(vllm_config.parallel_config, "enable_dbo", False))
        # When the forward that computed each prompt P offers ended: the steps
        # are numbered, the workers stamp each one's end, and a request notes
        # the step that computes the rest of its prompt.
        self._clock: ForwardClock | None = None
        self._no_clock = False  # the file could not be made: not tried again
        self._clock_since = 0  # the step it was made in
        self._step = 0
        self._prefilling: dict[str, Request] = {}
        self._prompt_step: dict[str, int] = {}

    def expand(self, per_group: Sequence[T]) -> tuple[T, ...]:
        """Per vLLM group -> per kvd group: each state part carries its group's entry."""
        return tuple(x for x, n in zip(per_group, self.parts, strict=True) for _ in range(n))

    def on_new_request(self, request: Request) -> None:
        """P's side of a model with state: stop short of the last prompt token.
        D computes that token itself, on top of the state P's prefill leaves,
        h(N - 1); were it P's h(N), the token would count twice (NIXL's
        ``_truncate_request_for_prefill``)."""
        params = request.kv_transfer_params
        if not any(self.state) or not params or not params.get("do_remote_decode") or params.get("_kvd_truncated"):
            return
        if request.prompt_token_ids is None or request.num_prompt_tokens < 2:
            return
        del request.prompt_token_ids[-1:]
        del request._all_token_ids[-1:]
        request.num_prompt_tokens -= 1
        request.max_tokens = 1
        params["_kvd_truncated"] = True

    def publish_for_engine(self, tokens: Sequence[bytes]) -> None:
        """The workers' tokens (vLLM's connector handshake, after they
        registered): from now on this scheduler publishes each finished
        request for every rank itself, as it finishes, so decode does not
        wait for P's next engine step, when the workers would publish it."""
        if not tokens:
            return
        try:
            # A short deadline: the engine's scheduling waits on this call.
            client = KvdClient(self.settings.address, WorkerId(self.engine_id), auth=self.settings.auth, timeout=PUBLISH_TIMEOUT_S)
        except KvdError as e:
            log.warning("kvd: daemon at %s unreachable; the workers publish each request: %s", self.settings.address, e.message)
            return
        client.worker_token = tokens[0]
        self._engine_client = client

    def _publish_now(self, rid: str, pub: Publication) -> TransferParams | None:
        """``pub`` published for every rank; None: the workers publish it on the next step."""
        client = self._engine_client
        if client is None or pub.request_id != rid:
            # A publication the proxy named: the workers must learn its name
            # before the daemon can report it, so they publish it themselves.
            return None
        now = time.monotonic()
        if now < self._engine_paused_until:
            return None
        try:
            params = params_from_pb(client.publish_engine(pub.request_id, pub.block_ids, pub.num_tokens, capability=pub.capability,
                                                          lease_seconds=pub.lease_seconds, first_tokens=pub.first_tokens, verify=pub.verify,
                                                          computed_at_ns=pub.computed_at_ns))
            if self._engine_paused_until:
                log.warning("kvd: the scheduler publishes for the engine again")
            self._engine_refusals, self._engine_paused_until = 0, 0.0
            return params
        except (PermissionDenied, FailedPrecondition) as e:
            # Refused again and again (a rank registered elsewhere, a worker
            # that registered with a daemon that issued it another token):
            # the workers publish for a while, then the scheduler tries again.
            self._engine_refusals += 1
            if isinstance(e, PermissionDenied) or self._engine_refusals >= ENGINE_REFUSALS_TO_PAUSE:
                if not self._engine_paused_until:
                    log.warning("kvd: the scheduler cannot publish for the engine; its workers publish each request, "
                                "and it tries again every %gs: %s", ENGINE_RETRY_S, e.message)
                self._engine_paused_until, self._engine_refusals = now + ENGINE_RETRY_S, 0
            else:
                log.info("kvd: publishing request %s from the scheduler was refused; its workers publish it: %s", rid, e.message)
        except KvdError as e:
            log.info("kvd: publishing request %s from the scheduler failed; its workers publish it: %s", rid, e.message)
        return None

    @property
    def engine_id(self) -> str:
        """The daemon's engine id (vLLM's own engine_id is a different name space)."""
        if not self._engine_id:
            self._engine_id = daemon_status(self.settings.address, self.settings.auth).engine_id
        return self._engine_id

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not is_kvd_load(params):
            return 0, False
        assert params is not None
        # D loads the prompt but its last token, less its own prefix-cache hit,
        # from wherever that ends (inside one of P's blocks too: tokens are
        # positions on both sides), and computes the last token itself for the
        # logits. Claiming that token too would be the same work (vLLM would
        # recompute it), but vLLM would then lay out a window group's blocks
        # for position N, and when N - W + 1 starts a block it would drop the
        # block holding token N - W, which position N - 1 attends to.
        count = len(request.prompt_token_ids or ()) - 1 - num_computed_tokens
        if count <= 0:
            return 0, False  # nothing to load: P is told to free its blocks after allocation
        try:
            check_params(params)
        except KvdError as e:
            # Compute the prompt here instead of waiting for a load that cannot happen.
            log.error("kvd: request %s: unusable kv_transfer_params, prefilling locally: %s", request.request_id, e.message)
            return 0, False
        return count, True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode"):
            self._prefilling[request.request_id] = request  # its prompt's last step is noted (build_connector_meta)
        if params and params.get("do_remote_decode") and params.get("kvd_stream"):
            if self.can_stream:
                self._stream_pending[request.request_id] = (request, blocks)  # published in the step that computes the rest of its prompt
            return
        if not is_kvd_load(params):
            return
        assert params is not None
        if num_external_tokens > 0:
            try:
                local = [_state_block(g, n) if st else _loadable(g, bs)
                         for g, bs, st, n in zip(blocks.blocks, self.block_sizes, self.state, self.scratch, strict=True)]
                self._to_load[request.request_id] = load_request(request.request_id, params, self.expand(local), self.expand(self.block_sizes),
                                                                 state=self.expand(self.state), prompt_tokens=len(request.prompt_token_ids or ()))
            except (KvdError, ValueError) as e:
                # Already claimed as a load: vLLM must hear it failed, with its blocks.
                log.error("kvd: request %s: cannot load from kv_transfer_params: %s", request.request_id, getattr(e, "message", e))
                self._failed_loads[request.request_id] = tuple(b for g in blocks.get_unhashed_block_ids_all_groups() for b in g)
                with contextlib.suppress(KvdError):  # and P need not hold what we will not read
                    self._to_release[request.request_id] = release_params(params)
        else:
            # A full local prefix hit: nothing to load, but P still holds the blocks for us.
            with contextlib.suppress(KvdError):
                self._to_release[request.request_id] = release_params(params)
        # One load per request, even if vLLM calls this again after the load.
        params["do_remote_prefill"] = False

    def shutdown(self) -> None:
        if self._clock is not None:
            self._clock.close()
            self._clock = None

    @property
    def has_streams(self) -> bool:
        """A streamed request runs: vLLM must not preempt to free blocks (decode may be reading them)."""
        return bool(self._streamed)

    def build_connector_meta(self, scheduler_output: Any) -> KvdConnectorMetadata:
        # A streaming request is published in the step that computes the rest of its prompt, before the step:
        # its workers say each layer saved as that forward computes it. A prompt vLLM computes in chunks (longer
        # than the step's token budget, or sharing it with running requests) streams its last chunk; earlier
        # steps wrote its earlier chunks' blocks. Not before: a layer saved by an earlier chunk is not saved for
        # the whole prompt, and the workers cannot tell the chunks apart.
        # Preempted since the last step, in schedule() or by reset_prefix_cache(reset_running_requests=True) (as
        # pause_generation clears the cache), so perhaps resumed (RUNNING) already: vLLM freed its blocks, so no read
        # may go on, nor is it streamed again (decode may have seen the end); decode computes it (its load fails).
        preempted = getattr(scheduler_output, "preempted_req_ids", None) or ()
        for rid, (name, request) in list(self._streamed.items()):
            if rid in preempted or request.status == RequestStatus.PREEMPTED:
                del self._streamed[rid]
                self._stream_pending.pop(rid, None)
                self._to_end[rid] = (name, False)
                if request.kv_transfer_params:
                    request.kv_transfer_params["do_remote_decode"] = False
        for rid, (request, blocks) in list(self._stream_pending.items()):
            if request.status == RequestStatus.PREEMPTED:
                del self._stream_pending[rid]  # its blocks were freed; allocated again (update_state_after_alloc) when it resumes
            elif _computes_rest_of_prompt(request, scheduler_output):
                del self._stream_pending[rid]
                # vLLM's own lists (get_blocks wraps the manager's req_to_blocks, which are only ever
                # changed in place while the request runs), grown by every chunk since, nulled where a window left them.
                block_ids = tuple(blocks.get_block_ids())
                short = self._short_group(block_ids, request.num_prompt_tokens)
                if short is not None:
                    # Not the blocks of the whole prompt (a vLLM that hands the
                    # connector a copy): published when it finishes, as pulled.
                    log.warning("kvd: request %s: group %d holds %d blocks for a %d-token prompt: not streamed", rid, short,
                                len(block_ids[short]), request.num_prompt_tokens)
                    continue
                pub = self._publication(request, block_ids, request.num_prompt_tokens, stream=True)
                if pub is not None:
                    self._to_publish[rid] = pub
                    self._streamed[rid] = (pub.request_id, request)
        self._step += 1
        for rid, request in list(self._prefilling.items()):
            if _computes_rest_of_prompt(request, scheduler_output):
                self._prompt_step[rid] = self._step
                del self._prefilling[rid]
        if self._clock is None and self._prompt_step and not self._no_clock:
            try:
                self._clock, self._clock_since = ForwardClock.create(self.tp_size * self.pp_size), self._step
            except OSError as e:  # a metric is not worth the engine: publish without stamps
                self._no_clock = True
                log.warning("kvd: no forward clock (kvd_publish_delay_seconds is not observed): %s", e)
        elif self._clock is not None and self._clock.linked and (self._clock.all_stamped() or self._step - self._clock_since > CLOCK_OPEN_STEPS):
            self._clock.unlink()  # every rank mapped it (or never will): nothing is left if the engine is killed
        idle = int(getattr(scheduler_output, "total_num_scheduled_tokens", 1) or 0) == 0
        meta = KvdConnectorMetadata(self._to_publish, self._to_load, self._failed_loads, self._to_release, self._to_end, idle,
                                    self._step, self._clock.path if self._clock is not None else "")
        self._to_publish, self._to_load, self._failed_loads, self._to_release, self._to_end = {}, {}, {}, {}, {}
        return meta

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        self._prefilling.pop(request.request_id, None)
        self._stream_pending.pop(request.request_id, None)  # ended before its prompt's last chunk
        step = self._prompt_step.pop(request.request_id, 0)
        streamed = self._streamed.pop(request.request_id, None)
        if streamed is not None:
            # Published before its prefill: hold the blocks until finished_sending, whatever happened.
            if request.status not in _PREFILL_DONE:
                self._to_end[request.request_id] = (streamed[0], True)  # aborted: its worker ends the publication, which frees them
            return True, None
        if not params or not params.get("do_remote_decode") or request.status not in _PREFILL_DONE or not any(block_ids):
            return False, None
        try:
            engine_id = self.engine_id
        except KvdError as e:
            # No daemon, no transfer: free the blocks now; D will find nothing to load.
            log.error("kvd: daemon at %s unreachable, request %s is not offered to decode: %s", self.settings.address, request.request_id, e.message)
            return False, None
        pub = self._publication(request, block_ids, int(request.num_computed_tokens), stream=False)
        if pub is None:
            return False, None
        if step and self._clock is not None:
            pub = dataclasses.replace(pub, computed_at_ns=self._clock.ended(step))
        published = self._publish_now(request.request_id, pub)
        self._to_publish[request.request_id] = dataclasses.replace(pub, published=published is not None)
        out = make_params(pub, engine_id=engine_id, address=self.settings.advertise_address, tp_size=self.tp_size, pp_size=self.pp_size,
                          block_size=self.block_size, published=published)
        # Keep P's blocks until its daemon reports the request in finished_sending.
        return True, out

    def _short_group(self, block_ids: Sequence[Sequence[int]], num_tokens: int) -> int | None:
        """The first attention group whose blocks do not cover ``num_tokens`` (None: all do)."""
        return next((g for g, (ids, bs, st) in enumerate(zip(block_ids, self.block_sizes, self.state, strict=True))
                     if not st and len(ids) * bs < num_tokens), None)

    def _publication(self, request: Request, block_ids: Sequence[Sequence[int]], computed: int, *, stream: bool) -> Publication | None:
        """What P's workers publish of ``request`` (None: nothing decode could load)."""
        params = request.kv_transfer_params or {}
        num_tokens = min([computed, *(len(ids) * bs for ids, bs, st in zip(block_ids, self.block_sizes, self.state, strict=True) if not st)])
        # Each group from its first real block: a window's null blocks hold nothing; a state group its running state.
        groups = [_state_block(ids, n) if st else group_blocks(ids, bs, num_tokens)
                  for ids, bs, st, n in zip(block_ids, self.block_sizes, self.state, self.scratch, strict=True)]
        if not all(g.ids for g in groups):
            # vLLM kept no block of a group (a prompt ending where a chunk
            # ends): decode could not load it, so it computes the prompt itself.
            log.info("kvd: request %s keeps no block of KV cache group %d: not offered to decode", request.request_id,
                     next(i for i, g in enumerate(groups) if not g.ids))
            return None
        try:  # the client's own: a malformed one is this request's problem, never the engine's
            asked = publish_asked(params, self.settings.lease_seconds)
        except KvdError as e:
            log.error("kvd: request %s: unusable kv_transfer_params, not offered to decode: %s", request.request_id, e.message)
            return None
        out = self.expand(groups)
        return Publication(asked.name or request.request_id, tuple(g.ids for g in out), num_tokens, asked.capability or secrets.token_bytes(32),
                           asked.lease_seconds, tuple(g.first_token for g in out), stream, verify=asked.verify)
