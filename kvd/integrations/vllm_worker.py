"""The worker side of kvd's vLLM connector (``KvdConnector`` in
``kvd.integrations.vllm`` delegates to it): registering the worker's caches
with the local daemon, publishing streamed requests, starting loads and
reporting their outcomes to vLLM.

One object per worker process (TP/PP rank), created by the connector.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvd.caches import (
    KVCacheTensors,
    adopt_into_shm,
    layer_index_of,
    release_all,
)
from kvd.client import (
    VLLM_NHD_DIMS,
    AfterDevice,
    Finished,
    KvdClient,
    daemon_status,
    infer_spec_from_tensors,
)
from kvd.convert import params_to_pb
from kvd.core.requests import TransferParams
from kvd.errors import KvdError, Status
from kvd.integrations.kv_params import Publication
from kvd.integrations.vllm_caches import (
    cpu_cache_registration,
    layer_groups,
    mamba_n_groups,
    rebind_layers,
    request_amx_permission,
    state_shape,
)
from kvd.integrations.vllm_clock import ForwardClock
from kvd.integrations.vllm_link import DaemonLink, send_release
from kvd.integrations.vllm_scheduler import KvdConnectorMetadata
from kvd.integrations.vllm_settings import Settings
from kvd.spec import (
    KVCacheSpec,
    ModelInfo,
    WorkerId,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("vllm.kvd")  # under vLLM's logger, so it prints with the engine's logs


# A lost registration's transfers are reported to vLLM at the latest this long
# after the loss, even if no daemon answered since: by then none serves them.
LOST_SETTLE_SECONDS = 30.0


@dataclass
class _LostTransfers:
    """A lost registration's outstanding transfers, until they are reported."""

    sending: set[str]
    loading: dict[str, tuple[set[int], TransferParams]]  # its blocks, and what it read (to release on P)
    at: float
    unreachable: bool  # the daemon was gone, and its work with it
    rejoined: threading.Event  # set once the worker registered again


_DEFINITE_REFUSALS = frozenset(Status) - {Status.INTERNAL, Status.UNAVAILABLE, Status.ABORTED, Status.DEADLINE_EXCEEDED}  # never started


class WorkerSide:
    def __init__(self, vllm_config: VllmConfig, settings: Settings, kv_cache_config: Any = None) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        self.settings = settings
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.tp_rank = int(get_tensor_model_parallel_rank())
        self.pp_rank = int(get_pp_group().rank_in_group)
        self.client: KvdClient | None = None
        self._done_sending: set[str] = set()  # failed publishes: free the blocks at once
        self._done_recving: set[str] = set()  # failed pulls
        self._lock = threading.Lock()  # guards _refused, which gRPC threads fill
        self._refused: dict[str, tuple[TransferParams, KvdError]] = {}  # pulls the daemon refused, not yet reported
        self._reported_failed: set[str] = set()  # refused pulls reported failed, in case the daemon's outcome comes after all
        self._failed_recving: set[str] = set()
        self._invalid: set[int] = set()
        # What the daemon still owes us an outcome for: if it goes away, its
        # publications and pulls are gone, and vLLM must hear so, not wait.
        self._sending: set[str] = set()
        self._loading: dict[str, tuple[set[int], TransferParams]] = {}  # its blocks, and what it reads
        # A publication named other than its request (streamed: the proxy named it) -> the request.
        self._names: dict[str, str] = {}
        # Published by the scheduler and already ended when its metadata came (not to be tracked then).
        self._ended_unseen: set[str] = set()
        self._streaming: list[str] = []  # names whose layers this step's forward saves
        self.after_device: AfterDevice | None = None
        # The link to the daemon, across its restarts (vllm_link.DaemonLink), and the transfers of a
        # registration it lost: reported to vLLM once their daemon can no longer touch their blocks.
        self.link: DaemonLink | None = None
        self._lost: list[_LostTransfers] = []
        self._reported_lost: set[str] = set()  # reported on a loss: a late outcome of theirs is not reported again
        # The scheduler's forward clock (vllm_clock), stamped as each forward ends; "" until it names one.
        self._clock: ForwardClock | None = None
        self._clock_path = ""
        self._clock_rank = self.pp_rank * int(vllm_config.parallel_config.tensor_parallel_size) + self.tp_rank

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        request_amx_permission()
        vc = self.vllm_config
        engine_id = daemon_status(self.settings.address, self.settings.auth).engine_id
        worker = WorkerId(engine_id, self.tp_rank, vc.parallel_config.tensor_parallel_size, self.pp_rank, vc.parallel_config.pipeline_parallel_size)
        by_group = layer_groups(self.kv_cache_config, kv_caches)
        tp = vc.parallel_config.tensor_parallel_size
        if any(kind.is_state for kind, _, _ in by_group) and vc.cache_config.mamba_cache_mode != "none":
            # In align mode a request's states are spread over position-indexed blocks with prefix caching.
            raise KvdError(f"kvd moves Mamba state with prefix caching off (mamba_cache_mode 'none'); this engine has {vc.cache_config.mamba_cache_mode!r}")
        model = ModelInfo(vc.model_config.get_total_num_hidden_layers(), vc.model_config.get_total_num_kv_heads())
        client = KvdClient(self.settings.address, worker, auth=self.settings.auth)
        client.wait_ready()
        on_gpu = next(iter(by_group[0][1].values())).is_cuda
        if not on_gpu:
            adopt_into_shm({f"{g}:{n}": t for g, (_, caches, _) in enumerate(by_group) for n, t in caches.items()})
            rebind_layers(vc, kv_caches)
        # Each vLLM group as kvd groups: a state group becomes one per state part.
        groups: list[tuple[KVCacheSpec, Mapping[str, KVCacheTensors]]] = []
        kinds, attention_dims = [], []
        for kind, caches, vllm_spec in by_group:
            if kind.is_state:
                # vLLM's pages are [blocks, 1, 1, page_bytes] int8: one group per state part.
                parts = state_shape(vllm_spec, tp, mamba_n_groups(vc)).layer_parts(caches, tp)
                groups += parts
                kinds += [kind] * len(parts)
                continue
            if on_gpu:
                # FlashAttention [2, blocks, tokens, heads, dim]; FlashInfer puts blocks first.
                first = next(iter(caches.values()))
                dims: Any = VLLM_NHD_DIMS if first.shape[0] == 2 else ("block", "kv", "token", "head", "dim")
                groups.append((infer_spec_from_tensors(caches, dims=dims), caches))  # type: ignore[arg-type]
            else:
                spec, registered, dims = cpu_cache_registration(vc, caches)
                groups.append((spec, registered))
            kinds.append(kind)
            attention_dims.append(dims)
        # One description of the tensors' dims serves every attention group (they share one attention kernel).
        if len({str(d) for d in attention_dims}) > 1:
            raise KvdError(f"KV cache groups need different attention layouts ({[str(d) for d in attention_dims]}); kvd registers one")
        register = functools.partial(client.register, groups, model, dims=attention_dims[0] if attention_dims else None, kinds=kinds)
        resp = register()
        self.client = client
        # The daemon pushes finished sets to the link's feed, so an engine step reads them without a round trip.
        self.link = DaemonLink(client, register, self.settings.address)
        self.after_device = AfterDevice(client, model.num_layers, cuda=on_gpu)
        for kind, (spec, layer_caches) in zip(kinds, groups, strict=True):
            log.info("kvd: registered %s with %s: group %s, %d layers, %d blocks of %d %s (layer order %s)", worker, self.settings.address,
                     kind, len(layer_caches), spec.num_blocks, spec.block_size, "state rows" if kind.is_state else "tokens",
                     [layer_index_of(n, i) for i, n in enumerate(layer_caches)][:4])
        log.info("kvd: %.1f MiB registered", resp.registered_bytes / 2**20)

    def publish_streams(self, meta: KvdConnectorMetadata) -> None:
        """Before the forward: end the streams whose requests ended (a
        preempted request's blocks are this step's to reuse), then publish
        this step's streams before the forward saves their first layer."""
        if self.client is None:
            return
        self.settle_link()  # a lost registration's transfers set aside before this step's start on the next
        for rid, (name, tell_vllm) in meta.to_end.items():
            if not tell_vllm:
                self._names[name] = ""  # vLLM freed the blocks itself: its end is not reported
                self._sending.discard(rid)
            with contextlib.suppress(KvdError):  # gone already: its end was reported
                self.client.abort(name)
            log.info("kvd: request %s ended before its streamed prefill was read: publication %s ended", rid, name)
        self._streaming = [pub.request_id for rid, pub in meta.to_publish.items() if pub.stream and self._publish(rid, pub)]

    def _publish(self, rid: str, pub: Publication) -> bool:
        assert self.client is not None
        try:
            self.client.publish(pub.request_id, pub.block_ids, pub.num_tokens, capability=pub.capability, lease_seconds=pub.lease_seconds,
                                first_tokens=pub.first_tokens, stream=pub.stream, verify=pub.verify,
                                # A stamp of the scheduler's host's clock, kept only where that is ours (we map its file).
                                computed_at_ns=pub.computed_at_ns if self._clock is not None else 0)
            self._sending.add(rid)
            if pub.request_id != rid:
                self._names[pub.request_id] = rid
            return True
        except KvdError as e:
            log.error("kvd: publishing request %s failed, freeing its blocks: %s", rid, e.message)
            self._done_sending.add(rid)
            return False

    def layer_saved(self, layer_name: str) -> None:
        if self._streaming and self.after_device is not None:
            self.after_device.saved(self._streaming, layer_index_of(layer_name, 0) + 1)

    def step_saved(self, meta: KvdConnectorMetadata | None) -> None:
        """The forward is over: every layer of this step's streams is written
        (state layers too, which save no layer), and the step's end is stamped."""
        if self._streaming and self.after_device is not None:
            self.after_device.saved(self._streaming, self.after_device.num_layers)
        self._streaming = []
        if meta is not None and meta.clock:
            if meta.clock != self._clock_path:
                if self._clock is not None:
                    self._clock.close()
                self._clock, self._clock_path = ForwardClock.open(meta.clock), meta.clock
            clock, rank, step = self._clock, self._clock_rank, meta.step
            if clock is None:
                return
            if self.on_gpu and self.after_device is not None:
                # The forward is only enqueued: its end is when the device gets here.
                self.after_device.run(lambda: clock.stamp(rank, step, time.time_ns()))
            else:
                clock.stamp(rank, step, time.time_ns())

    def start(self, meta: KvdConnectorMetadata) -> None:
        client = self.client
        if client is None:
            return
        self.settle_link()
        for rid, pub in meta.to_publish.items():
            if pub.published:  # by the scheduler, for every rank: only its outcome is ours to track
                if rid in self._ended_unseen:
                    self._ended_unseen.discard(rid)
                else:
                    self._sending.add(rid)
            elif not pub.stream:  # streams were published before the forward
                self._publish(rid, pub)
        for rid, release in meta.to_release.items():
            self._release(client, rid, release)
        for rid, ids in meta.failed_loads.items():
            self._done_recving.add(rid)
            self._failed_recving.add(rid)
            self._invalid.update(ids)
        self.start_loads(meta)

    @property
    def on_gpu(self) -> bool:
        return self.after_device is not None and self.after_device.cuda

    def start_loads(self, meta: KvdConnectorMetadata) -> None:
        """Start this step's loads; the next poll reports a refusal. vLLM zeroes
        new blocks before the forward, on a GPU only enqueued and unordered with
        the daemon's copies: GPU loads start at ``bind``, from ``AfterDevice``
        once the stream got past it, waiting for no answer. Host loads start after
        the forward, as vLLM's, and wait: going on at once let the next CPU forward
        take the cores from the daemon (real-engine bench: pull 23 ms, not 10)."""
        client, after = self.client, self.after_device
        if client is None or after is None:
            return
        self.settle_link()
        for rid, load in meta.to_load.items():
            self._loading[rid] = ({i for g in load.local_block_ids for i in g}, load.params)
            answered = functools.partial(self._pull_answered, rid, load.params)
            params = params_to_pb(load.params)  # the client's message
            if after.cuda:
                after.run(functools.partial(client.pull_nowait, rid, params, load.local_block_ids, first_tokens=load.local_first_tokens,
                                            answered=answered, priority=load.priority, tenant=load.tenant, deadline_ms=load.deadline_ms))
                continue
            try:
                client.pull(rid, params, load.local_block_ids, first_tokens=load.local_first_tokens,
                            priority=load.priority, tenant=load.tenant, deadline_ms=load.deadline_ms)
            except KvdError as e:
                answered(e)
        meta.to_load = {}  # started: once per step, whichever hook got there first

    def _release(self, client: KvdClient, rid: str, params: TransferParams) -> None:
        """Tell P, through our daemon, that we will not read ``params``; if the daemon is down, once it is back."""
        if self.link is not None:
            self.link.release(rid, params)
        else:
            send_release(client, rid, params)

    def _pull_answered(self, rid: str, params: TransferParams, error: KvdError | None) -> None:
        """Keep a refusal for the engine's next poll (from a gRPC thread for GPU loads)."""
        if error is not None:
            with self._lock:
                self._refused[rid] = (params, error)

    def _report_refused(self, out: KVConnectorTransferResults) -> None:
        """Pulls the daemon refused: failed loads, every block invalid."""
        assert self.client is not None
        with self._lock:
            refused, self._refused = self._refused, {}
        for rid, (params, error) in refused.items():
            entry = self._loading.pop(rid, None)
            if entry is None:
                continue  # its outcome came first: the daemon took it, and only its answer was lost
            ids = entry[0]
            log.error("kvd: load of request %s refused by the local daemon (%s): %s", rid, error.status.name, error.message)
            self._release(self.client, rid, params)  # P need not hold what we will not read
            out.finished_recving.add(rid)
            out.failed_recving.add(rid)
            self._invalid |= ids
            if error.status not in _DEFINITE_REFUSALS:  # a definite refusal has no outcome to come
                self._reported_failed.add(rid)

    def poll(self, idle: bool = False) -> KVConnectorTransferResults:
        """What finished since the last step. On an ``idle`` step (it computed
        nothing) with transfers outstanding and nothing to report yet, wait
        up to ``idle_wait_seconds`` for the daemon to push an outcome first:
        vLLM steps in a tight loop while it holds requests for transfers, and
        its spinning workers starved every process sharing their cores."""
        self.settle_link()
        feed = self.link.feed if self.link is not None else None
        if (idle and feed is not None and (self._sending or self._loading) and not self._refused
                and not (self._done_sending or self._done_recving or self._failed_recving)):
            feed.wait(self.settings.idle_wait_seconds)
        if feed is not None:
            self._absorb(feed.take())
        out = KVConnectorTransferResults(set(self._done_sending), set(self._done_recving), set(self._failed_recving))
        self._done_sending.clear()
        self._done_recving.clear()
        self._failed_recving.clear()
        if self._refused:  # (read unlocked: a refusal that comes now waits for the next poll)
            self._report_refused(out)
        return out

    def _absorb(self, f: Finished) -> None:
        """A feed's outcomes into what the next poll reports, each once."""
        # Streamed publications were named by the proxy: vLLM knows their requests.
        f.finished_sending = {self._names.pop(n, n) for n in f.finished_sending} - {""}
        # Reported when their registration was lost: vLLM heard of them already.
        f.finished_sending -= self._reported_lost
        f.finished_recving -= self._reported_lost
        for lost in self._lost:  # the daemon's own outcome settles a lost transfer
            lost.sending -= f.finished_sending
            for rid in f.finished_recving:
                lost.loading.pop(rid, None)
        # Only one the scheduler published can end before we hear of it (vLLM holds its blocks all the same).
        self._ended_unseen |= f.finished_sending - self._sending
        self._sending -= f.finished_sending
        if late := self._reported_failed & f.finished_recving:
            # Reported failed when the answer to its Pull was lost, yet the daemon had taken it: vLLM heard of it once.
            f.finished_recving -= late
            self._reported_failed -= late
        for rid in f.finished_recving:
            self._loading.pop(rid, None)
        self._done_sending |= f.finished_sending
        self._done_recving |= f.finished_recving
        self._failed_recving |= {rid for (direction, rid), d in f.details.items()
                                 if direction == "recving" and d.outcome != "done" and rid in f.finished_recving}
        self._invalid |= f.invalid_block_ids
        for (direction, rid), d in f.details.items():
            if d.outcome != "done":
                # One line an operator can act on: the daemon's reason names the peer, the phase and what landed.
                what = "load" if direction == "recving" else "send"
                log.warning("kvd: %s of request %s %s: %s", what, rid, d.outcome, d.reason)

    def settle_link(self) -> None:
        """On the engine thread, before it starts or reports anything: a lost
        registration's outstanding transfers are set aside, the new one's
        feed taken up, and the set-aside ones reported (sends finished, loads
        failed, their blocks invalid) once no daemon can touch their blocks:
        the daemon was unreachable, or the worker registered again (which ends
        the old registration's work), or ``LOST_SETTLE_SECONDS`` passed."""
        link = self.link
        if link is None:
            return
        loss = link.take_loss()
        now = time.monotonic()
        if loss is not None:
            feed, unreachable, rejoined = loss
            self._absorb(feed.take())  # what it received before it failed
            if self._sending or self._loading:
                log.error("kvd: %d sends and %d loads of the lost registration end (%s)", len(self._sending), len(self._loading),
                          "the daemon is unreachable" if unreachable else "once the worker registered again")
            self._lost.append(_LostTransfers(self._sending, self._loading, now, unreachable, rejoined))
            self._sending, self._loading = set(), {}
        link.swap()
        for lost in list(self._lost):
            if lost.unreachable or lost.rejoined.is_set() or now - lost.at > LOST_SETTLE_SECONDS:
                self._lost.remove(lost)
                self._done_sending |= lost.sending
                self._done_recving |= set(lost.loading)
                self._failed_recving |= set(lost.loading)
                for rid, (ids, params) in lost.loading.items():
                    self._invalid |= ids
                    link.release_later(rid, params)  # no pull of ours reads it any more: P may free it
                self._reported_lost |= lost.sending | set(lost.loading)
        link.flush_releases()

    def take_invalid(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        if len(getattr(self.kv_cache_config, "kv_cache_groups", None) or ()) > 1:
            # Block ids repeat across groups, so vLLM takes a failed load with
            # several groups only as a request in failed_recving (already
            # there): it then recomputes the whole prompt.
            return set()
        return out

    def shutdown(self) -> None:
        if self._clock is not None:
            self._clock.close()
            self._clock = None
        if self.after_device is not None:
            self.after_device.close()
        if self.link is not None:
            self.link.close()  # first: unregistering ends the stream, which is no failure here; and no rejoin after it
            self.link = None
        if self.client is not None:
            try:
                self.client.unregister()
            except KvdError as e:
                log.info("kvd: unregister failed: %s", e.message)
            self.client.close()
            self.client = None
            release_all()  # unlinks the names; the mappings live until the process ends
