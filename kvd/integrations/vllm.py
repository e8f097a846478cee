"""A vLLM ``KVConnectorBase_V1`` that hands every transfer to the local kvd daemon.

Load it with::

    kv_transfer_config={
        "kv_connector": "KvdConnector",
        "kv_connector_module_path": "kvd.integrations.vllm",
        "kv_role": "kv_producer",            # P; "kv_consumer" on D, or "kv_both"
        "kv_connector_extra_config": {"kvd_address": "127.0.0.1:50051"},
    }

Extra config keys (all optional):

* ``kvd_address``: the local daemon's gRPC address (``host:port`` or
  ``unix:/path``; default ``127.0.0.1:50051``);
* ``kvd_advertise_address``: the ``host:port`` D's daemon dials to reach P's
  (default: ``kvd_address``);
* ``kvd_lease_seconds``: how long P holds a request's blocks for D without a
  heartbeat (default: the daemon's ``lease_seconds``);
* ``kvd_auth``, ``kvd_token_file``, ``kvd_tls_cert_file``, ``kvd_tls_key_file``,
  ``kvd_tls_ca_file``: as the daemon's ``auth`` settings.

How a request flows (the P/D split of vLLM's NixlConnector):

1. P runs the prefill with ``kv_transfer_params={"do_remote_decode": True}``.
   Its scheduler's ``request_finished`` keeps the blocks (delay free), picks a
   capability, publishes the blocks for every rank to its daemon under that
   capability and lease (``PublishEngine``, with a worker's token from vLLM's
   connector handshake), and returns params naming P's daemon, the blocks,
   the capability and the publication's generation. Where the scheduler may
   not (a rank registered elsewhere), P's workers publish on the next step,
   and D's daemon resolves the params first.
2. D gets those params with the same prompt. ``get_num_new_matched_tokens``
   claims the prompt as an asynchronous load; once blocks are allocated,
   D's worker asks its daemon to pull; the daemon reads P's blocks straight
   into D's registered cache (relayout and re-blocking on receipt).
3. D's daemon reports the request in ``finished_recving`` (failed blocks in
   ``get_block_ids_with_load_errors``); P's reports it in ``finished_sending``
   once every reader acknowledged, or when the lease expires. vLLM then frees
   P's blocks.

CPU caches are moved into POSIX shared memory once, at registration (the same
tensor objects, re-pointed), so the daemon maps them; GPU caches are shared by
CUDA IPC. Nothing is copied per request by the engine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvd.integrations.vllm_scheduler import KvdConnectorMetadata, SchedulerSide
from kvd.integrations.vllm_settings import Settings
from kvd.integrations.vllm_worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvd")  # under vLLM's logger, so it prints with the engine's logs


@dataclass
class KvdHandshakeMetadata(KVConnectorHandshakeMetadata):
    """What a worker tells its engine's scheduler once it registered (vLLM's
    connector handshake): its token, so the scheduler may publish finished
    requests for the whole engine (``PublishEngine``)."""

    worker_token: str  # hex


class KvdConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's connector API on top of a kvd daemon; one object per role.

    It supports vLLM's hybrid allocator (HMA), so a model whose layers attend
    differently keeps one block table per KV cache group: a sliding-window
    group holds, and kvd moves, only its last window."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        settings = Settings.from_vllm(vllm_config)
        self._scheduler = SchedulerSide(vllm_config, settings, kv_cache_config) if role == KVConnectorRole.SCHEDULER else None
        self._worker = WorkerSide(vllm_config, settings, kv_cache_config) if role == KVConnectorRole.WORKER else None

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """As the base: for a kvd load, the prompt P holds past our own prefix, all but the last token (D computes it), always loaded asynchronously."""
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request: Request) -> None:
        """Beyond the base: on P, a model with state stops one prompt token short, as NixlConnector does."""
        if self._scheduler is not None:
            self._scheduler.on_new_request(request)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """As the base: D queues the load into the blocks vLLM just allocated; P notes a request to stream."""
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """As the base; the metadata also says what to publish, release and end, and whether the step computes nothing (idle)."""
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """As the base, for one group: see ``request_finished_all_groups``."""
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """As the base (HMA): P holds the blocks until finished_sending and returns kvd's params; it also publishes them here, for every rank, when it can."""
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def has_pending_block_frees(self) -> bool:
        """True while a streamed request runs: vLLM then waits for blocks rather
        than preempting one (its blocks may be being read); it finishes within a step or two."""
        return self._scheduler is not None and self._scheduler.has_streams

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """Every group: a load restores the request's own blocks in each."""
        assert self._scheduler is not None
        return tuple(range(len(self._scheduler.block_sizes)))

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """The workers' tokens, not transport addresses: the scheduler publishes for the engine with them."""
        self.set_xfer_handshake_metadata_pp_aware({(0, tp): m for tp, m in metadata.items()})

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]) -> None:
        """Every rank's token, pipeline stages included: kvd moves PP ranks like any other."""
        if self._scheduler is not None:
            self._scheduler.publish_for_engine([bytes.fromhex(m.worker_token) for _, m in sorted(metadata.items())
                                                if isinstance(m, KvdHandshakeMetadata) and m.worker_token])

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """kvd reads any layout from the registered strides and turns it into
        the reader's on receipt, so it asks for none unless configured to."""
        kvt = vllm_config.kv_transfer_config
        extra = dict(kvt.kv_connector_extra_config or {}) if kvt else {}
        layout = extra.get("kvd_kv_cache_layout")
        return str(layout) if layout else None

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """As the base, but the caches are registered with the local daemon, which maps them itself (adopted into shared memory on CPU)."""
        assert self._worker is not None
        self._worker.register(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """This worker's daemon token (for the scheduler), not a transport address: peers meet through the daemons."""
        client = self._worker.client if self._worker is not None else None
        return KvdHandshakeMetadata(client.worker_token.hex()) if client is not None and client.worker_token else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """As the base, and before the forward: streams are published, and GPU loads start."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KvdConnectorMetadata):
            # Before the forward: what streams must be published before its first layer is saved.
            self._worker.publish_streams(connector_metadata)
            if self._worker.on_gpu:
                # GPU caches: the loads now, each once the stream got past vLLM's zeroing of its blocks.
                self._worker.start_loads(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """As the base, but host-cache loads start after the forward and GPU ones at bind; P's workers publish what the scheduler could not."""
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvdConnectorMetadata)
        self._worker.start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: loads are whole-request and asynchronous, and vLLM
        schedules a request only after finished_recving named it."""
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing is copied (the daemon reads the registered cache in place); a
        streaming prefill says the layer is saved, without waiting."""
        if self._worker is not None:
            self._worker.layer_saved(layer_name)

    def wait_for_save(self) -> None:
        """Nothing is copied (the daemon reads the cache in place); a streaming
        prefill says every layer is saved; the forward's end is stamped for the scheduler."""
        if self._worker is not None:
            self._worker.step_saved(self._bound_meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """As the base: the daemon's pushed outcomes, with no round trip; see ``get_transfer_results`` for an idle step."""
        assert self._worker is not None
        r = self._worker.poll(self._idle_step())
        return (r.finished_sending or None), (r.finished_recving or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Unlike the base contract's cheap query, an idle step may wait a few
        ms here for the daemon's news (``WorkerSide.poll``)."""
        assert self._worker is not None
        return self._worker.poll(self._idle_step())

    def _bound_meta(self) -> KvdConnectorMetadata | None:
        meta = getattr(self, "_connector_metadata", None)  # bound for this step by vLLM
        return meta if isinstance(meta, KvdConnectorMetadata) else None

    def _idle_step(self) -> bool:
        meta = self._bound_meta()
        return meta is not None and meta.idle

    def get_block_ids_with_load_errors(self) -> set[int]:
        """As the base: exactly the blocks that did not land (every block of a load the daemon refused)."""
        assert self._worker is not None
        return self._worker.take_invalid()

    def shutdown(self) -> None:
        """As the base, and the worker unregisters from its daemon, which unmaps its memory."""
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
