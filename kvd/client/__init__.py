"""The API engine workers use to talk to their local kvd daemon.

For a vLLM developer, the mapping is:

* ``register`` is ``KVConnectorBase_V1.register_kv_caches``: pass the
  ``dict[layer_name, Tensor]`` your worker allocated (per KV cache group) and
  the daemon maps that memory itself -- shm for CPU, CUDA IPC for GPU.
* ``publish`` is what the prefill side does in ``request_finished``: it holds
  the blocks under a lease and returns the ``kv_transfer_params`` decode needs.
* ``pull`` is ``start_load_kv`` on the decode side: asynchronous; the daemon
  reads the blocks straight into your registered memory.
* ``get_finished`` is ``get_finished`` (finished_sending, finished_recving)
  plus ``get_block_ids_with_load_errors`` (invalid_block_ids), drained per call.
  Per engine step, use a ``FinishedFeed`` instead: the daemon pushes the same
  sets and ``take`` reads them with no round trip.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from kvd.auth import WORKER_TOKEN_HEADER, AuthConfig
from kvd.client.after_device import AfterDevice
from kvd.client.finished import Finished, FinishedFeed
from kvd.convert import outcome_from_pb, worker_to_pb
from kvd.errors import DeadlineExceeded, KvdError, Unavailable, from_code
from kvd.proto import kvd_pb2 as pb
from kvd.proto import kvd_pb2_grpc as pbg
from kvd.spec import GroupKind, KVCacheSpec, ModelInfo, WorkerId, infer_spec

if TYPE_CHECKING:
    from kvd.caches import KVCacheTensors

# The public API (tests/test_public_api.py pins it): the client and what it
# takes and raises, re-exported from where they live.
__all__ = [
    "VLLM_NHD_DIMS", "WORKER_TOKEN_HEADER", "AfterDevice", "DeadlineExceeded", "Finished", "FinishedFeed", "FinishedStream",
    "GroupKind", "KVCacheSpec", "KvdClient", "KvdError", "ModelInfo", "Unavailable", "WorkerId", "daemon_status", "from_code",
    "infer_spec", "infer_spec_from_tensors",
]

VLLM_NHD_DIMS = ("kv", "block", "token", "head", "dim")


def infer_spec_from_tensors(
    kv_caches: Mapping[str, KVCacheTensors], *, dims: Sequence[str] | None = None, block_size: int = 0, use_mla: bool = False
) -> KVCacheSpec:
    """A spec from the first tensor's shape, strides and dtype."""
    first = next(iter(kv_caches.values()))
    t = first[0] if isinstance(first, tuple) else first
    names = tuple(dims or (("block", "token", "dim") if use_mla else VLLM_NHD_DIMS))
    if isinstance(first, tuple) and "kv" in names:
        names = tuple(d for d in names if d != "kv")
    return infer_spec(names, tuple(t.shape), tuple(t.stride()), str(t.dtype).removeprefix("torch."), use_mla=use_mla, block_size=block_size)


def _finished_from_pb(r: pb.GetFinishedResponse) -> Finished:
    return Finished(set(r.finished_sending), set(r.finished_recving), set(r.invalid_block_ids), {(d.direction, d.request_id): outcome_from_pb(d) for d in r.details})


def daemon_status(address: str, auth: AuthConfig | None = None, timeout: float = 30.0, *, wait_ready: bool = True) -> pb.StatusResponse:
    """The daemon's Admin.Status (its engine id, epoch, workers, leases, ...);
    with ``wait_ready``, waiting up to ``timeout`` for it to come up."""
    auth = auth or AuthConfig()
    creds = auth.channel_credentials()
    channel = grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)
    try:
        # wait_for_ready on the call, not channel_ready_future: that polls the
        # channel every 200 ms, so every status call took at least that long.
        return pbg.AdminStub(channel).Status(pb.StatusRequest(), timeout=timeout, metadata=auth.call_metadata(), wait_for_ready=wait_ready)
    except grpc.RpcError as e:
        if wait_ready and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise DeadlineExceeded(f"kvd daemon at {address} not reachable (or not answering) after {timeout}s") from None
        raise from_code(e.code().name, e.details() or "") from None
    finally:
        channel.close()


class KvdClient:
    """A worker's connection to its local daemon (blocking calls)."""

    def __init__(self, address: str, worker: WorkerId, *, timeout: float = 30.0, auth: AuthConfig | None = None) -> None:
        """``address`` is host:port or unix:/path; ``auth`` as the daemon's (token or mTLS)."""
        self.address = address
        self.worker = worker
        self.timeout = timeout
        self.auth = auth or AuthConfig()
        # The daemon is local: after it restarts (a sidecar upgrade) the worker
        # tries again about a second after it answers. gRPC's default backoff
        # grows to 120 s; behind a 20 s restart the worker rejoined 6-17 s late.
        # (Not min_reconnect_backoff_ms: gRPC takes it as the connect timeout too.)
        options = [("grpc.max_send_message_length", 16 << 20), ("grpc.max_receive_message_length", 16 << 20),
                   ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]
        creds = self.auth.channel_credentials()
        self._channel = grpc.secure_channel(address, creds, options=options) if creds else grpc.insecure_channel(address, options=options)
        self._worker = pbg.WorkerStub(self._channel)
        self._wid = worker_to_pb(worker)
        self.worker_token = b""  # issued by register(); proves we are this worker
        # The first token issued: registering again proposes it, so the token
        # others learned then (vLLM's scheduler) stays good across daemon restarts.
        self._first_token = b""
        self._saves: collections.deque[Any] = collections.deque()  # layers_saved calls in flight

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        token = ((WORKER_TOKEN_HEADER, self.worker_token.hex()),) if self.worker_token else ()
        return (*self.auth.call_metadata(), *token)

    def _call(self, method, request):  # type: ignore[no-untyped-def]
        try:
            return method(request, timeout=self.timeout, metadata=self._metadata())
        except grpc.RpcError as e:
            raise from_code(e.code().name, e.details() or "") from None

    def wait_ready(self, timeout: float = 30.0) -> None:
        grpc.channel_ready_future(self._channel).result(timeout=timeout)

    def register(
        self,
        kv_caches: Mapping[str, KVCacheTensors] | Sequence[tuple[KVCacheSpec, Mapping[str, KVCacheTensors]]],
        model: ModelInfo,
        spec: KVCacheSpec | None = None,
        *,
        dims: Sequence[str] | Sequence[Sequence[str]] | None = None,
        block_size: int = 0,
        use_mla: bool = False,
        kinds: Sequence[GroupKind] = (),
    ) -> pb.RegisterResponse:
        """Register one group (``kv_caches`` + ``spec``) or several ``(spec, kv_caches)`` groups.

        With a single ``dict[layer_name, Tensor]`` and no ``spec``, the spec is
        inferred from the first tensor's shape, strides and dtype; ``dims``
        names its dims in shape order (vLLM FlashAttention's
        ``(kv, block, token, head, dim)`` by default), and an HND cache shows up
        through its strides. ``dims`` may also name each part's dims (K, V)
        when they differ, as for vLLM's CPU attention (``CPU_ATTENTION_PARTS``).
        """
        if isinstance(kv_caches, Mapping):
            if spec is None:
                spec = infer_spec_from_tensors(kv_caches, dims=dims, block_size=block_size, use_mla=use_mla)  # type: ignore[arg-type]
                dims = dims or VLLM_NHD_DIMS
            groups = [(spec, kv_caches)]
        else:
            groups = list(kv_caches)
        # Imported here: kvd.caches imports torch, which a worker has loaded
        # already and `kvd status` need not load (2 s).
        from kvd.caches import alive_token, describe

        described = describe(groups, dims=dims, kinds=kinds)  # type: ignore[arg-type]
        resp = self._call(self._worker.Register, pb.RegisterRequest(
            worker=self._wid, model=pb.ModelInfo(num_layers=model.num_layers, total_num_kv_heads=model.total_num_kv_heads),
            regions=described.regions, groups=described.groups,
            worker_token=self._first_token, alive_shm=alive_token(),
        ))
        self.worker_token = resp.worker_token
        self._first_token = self._first_token or resp.worker_token
        return resp

    def publish(self, request_id: str, block_ids: Sequence[Sequence[int]], num_tokens: int, *, capability: bytes = b"", reader_engine_id: str = "",
                lease_seconds: float = 0.0, first_tokens: Sequence[int] = (), stream: bool = False, verify: str = "",
                computed_at_ns: int = 0) -> pb.TransferParams:
        """Offer this worker's blocks of ``request_id``, per group; a group's
        ids hold the tokens from its ``first_tokens`` entry on (0 if none).
        ``stream``: offered before they are computed (layer-wise streaming);
        each layer is served once ``layers_saved`` says it is written.
        ``verify``: this request's verification (off, sampled, full), else the daemon's.
        ``computed_at_ns``: when the forward that computed the prompt ended
        (``time.time_ns()``), for ``kvd_publish_delay_seconds``."""
        resp = self._call(self._worker.Publish, pb.PublishRequest(
            worker=self._wid, request_id=request_id, block_ids=_block_ids(block_ids, first_tokens),
            num_tokens=num_tokens, capability=capability, reader_engine_id=reader_engine_id, lease_seconds=lease_seconds,
            stream=stream, verify=verify, computed_at_unix_nanos=computed_at_ns,
        ))
        return resp.params

    def publish_engine(self, request_id: str, block_ids: Sequence[Sequence[int]], num_tokens: int, *, capability: bytes = b"",
                       reader_engine_id: str = "", lease_seconds: float = 0.0, first_tokens: Sequence[int] = (), verify: str = "",
                       computed_at_ns: int = 0) -> pb.TransferParams:
        """Offer ``request_id``'s blocks on every rank of this engine at once
        (the engine's scheduler, with a registered worker's ``worker_token``);
        refused unless every rank is registered with this daemon.
        ``computed_at_ns`` as for ``publish``."""
        resp = self._call(self._worker.PublishEngine, pb.PublishEngineRequest(
            engine_id=self.worker.engine_id, request_id=request_id, block_ids=_block_ids(block_ids, first_tokens),
            num_tokens=num_tokens, capability=capability, reader_engine_id=reader_engine_id, lease_seconds=lease_seconds, verify=verify,
            computed_at_unix_nanos=computed_at_ns,
        ))
        return resp.params

    def layers_saved(self, request_ids: Sequence[str], layers_saved: int, *, wait: bool = False) -> None:
        """Layer-wise streaming: every model layer below ``layers_saved`` of
        these streaming publications is written on this rank. Sent without
        waiting (prefill must never wait on the network); a call the daemon
        refused raises from a later one, or from ``flush_saves``. A count past
        the model's layers is refused (``InvalidArgument``)."""
        req = pb.LayersSavedRequest(worker=self._wid, request_ids=list(request_ids), layers_saved=layers_saved)
        earlier = len(self._saves)
        if wait:
            self._call(self._worker.LayersSaved, req)
        else:
            self._saves.append(self._worker.LayersSaved.future(req, timeout=self.timeout, metadata=self._metadata()))
        # After sending, so an earlier refusal cannot lose this save; only the
        # earlier ones, so this call's own refusal always surfaces from a later
        # call, however fast the daemon answered.
        self._check_saves(block=False, limit=earlier)

    def flush_saves(self) -> None:
        """Wait for every ``layers_saved`` sent so far; raise the first refusal."""
        self._check_saves(block=True)

    def _check_saves(self, *, block: bool, limit: int | None = None) -> None:
        checked = 0
        while self._saves and (limit is None or checked < limit) and (block or self._saves[0].done()):
            checked += 1
            f = self._saves.popleft()
            try:
                f.result()
            except grpc.RpcError as e:
                raise from_code(e.code().name, e.details() or "") from None

    def pull(self, request_id: str, params: pb.TransferParams, local_block_ids: Sequence[Sequence[int]], *, first_tokens: Sequence[int] = (),
             priority: str = "", tenant: str = "", deadline_ms: float = 0.0) -> None:
        """Read ``params``' blocks into ours, per group from its ``first_tokens``
        entry on (0 if none); each group moves only what decode needs of it.
        ``priority``, ``tenant`` and ``deadline_ms`` place it on a contended
        wire (a daemon with ``--qos on``; see ``kvd.core.qos``)."""
        self._call(self._worker.Pull, pb.PullRequest(
            worker=self._wid, request_id=request_id, params=params, local_block_ids=_block_ids(local_block_ids, first_tokens),
            priority=priority, tenant=tenant, deadline_ms=deadline_ms,
        ))

    def pull_nowait(self, request_id: str, params: pb.TransferParams, local_block_ids: Sequence[Sequence[int]], *,
                    first_tokens: Sequence[int] = (), answered: Callable[[KvdError | None], None],
                    priority: str = "", tenant: str = "", deadline_ms: float = 0.0) -> None:
        """``pull`` without waiting for the daemon's answer: ``answered`` is
        called (on a gRPC thread) with None once the daemon accepted it, or
        with why it did not. The caller (a thread an engine step hands its
        loads to) goes on at once, and a daemon slow to answer (busy, or
        stuck) holds nothing up: the load fails at the call's timeout."""
        future = self._worker.Pull.future(pb.PullRequest(
            worker=self._wid, request_id=request_id, params=params, local_block_ids=_block_ids(local_block_ids, first_tokens),
            priority=priority, tenant=tenant, deadline_ms=deadline_ms,
        ), timeout=self.timeout, metadata=self._metadata())

        def done(f: Any) -> None:
            if f.cancelled():
                answered(Unavailable(f"pull of request_id={request_id!r}: the call was cancelled (the client closed)"))
                return
            e = f.exception()
            answered(None if e is None else from_code(e.code().name, e.details() or ""))

        future.add_done_callback(done)

    def abort(self, request_id: str, *, release: pb.TransferParams | None = None) -> bool:
        """Cancel this worker's pull or publication of ``request_id``; with
        ``release``, also tell that publication's owner it will not be read."""
        return bool(self._call(self._worker.Abort, pb.AbortRequest(worker=self._wid, request_id=request_id, release=release)).found)

    def get_finished(self) -> Finished:
        """This worker's finished_sending / finished_recving / invalid_block_ids since the last call."""
        return _finished_from_pb(self._call(self._worker.GetFinished, pb.GetFinishedRequest(worker=self._wid)))

    def watch_finished(self, resume_after: int | None = None) -> FinishedStream:
        """This worker's finished sets, pushed as they happen: first the backlog
        (even empty), then each outcome. It drains the box ``get_finished``
        drains: each outcome arrives once, through one or the other. Reopening
        a broken stream, ``resume_after`` (its ``last_seq``) has the daemon
        resend what the break may have lost. Only the newest stream pushes."""
        req = pb.GetFinishedRequest(worker=self._wid, resume_after=resume_after)
        return FinishedStream(self._worker.WatchFinished(req, metadata=self._metadata()), resume_after or 0)

    def wait_finished(self, recving: set[str] = frozenset(), sending: set[str] = frozenset(), timeout: float = 60.0, poll: float = 0.001) -> Finished:  # type: ignore[assignment]
        """Poll until every id in ``recving``/``sending`` is reported; returns all seen."""
        seen = Finished()
        deadline = time.monotonic() + timeout
        while not (recving <= seen.finished_recving and sending <= seen.finished_sending):
            if time.monotonic() > deadline:
                raise DeadlineExceeded(f"not finished after {timeout}s: recving={sorted(recving - seen.finished_recving)[:5]} sending={sorted(sending - seen.finished_sending)[:5]}")
            seen.merge(self.get_finished())
            time.sleep(poll)
        return seen

    def engine_finished(self) -> Finished:
        """The engine's merged sets (a request appears once every expected worker reported it)."""
        r = self._call(self._worker.GetEngineFinished, pb.EngineFinishedRequest(engine_id=self.worker.engine_id))
        return _finished_from_pb(r)

    def watch_engine_finished(self) -> Iterator[Finished]:
        """Yields the engine's merged sets as requests complete (a server stream)."""
        stream = self._worker.WatchEngineFinished(pb.EngineFinishedRequest(engine_id=self.worker.engine_id), metadata=self._metadata())
        try:
            for r in stream:
                yield _finished_from_pb(r)
        finally:
            stream.cancel()

    def set_expected_finished_count(self, count: int) -> int:
        """How many workers must report a request before the engine sees it (0: world size)."""
        r = self._call(self._worker.SetExpectedFinishedCount, pb.SetExpectedFinishedCountRequest(engine_id=self.worker.engine_id, expected_finished_count=count))
        return int(r.expected_finished_count)

    def unregister(self) -> None:
        self._call(self._worker.Unregister, pb.UnregisterRequest(worker=self._wid))

    def close(self) -> None:
        self._channel.close()


def _block_ids(block_ids: Sequence[Sequence[int]], first_tokens: Sequence[int]) -> list[pb.BlockIds]:
    return [pb.BlockIds(ids=list(b), first_token=first_tokens[g] if g < len(first_tokens) else 0) for g, b in enumerate(block_ids)]


class FinishedStream:
    """An open WatchFinished stream: iterate it for the pushed sets (a failure
    raises its KvdError); ``cancel`` ends it from any thread."""

    def __init__(self, call: grpc.Call, resume_after: int = 0) -> None:
        self._call = call
        self.last_seq = resume_after  # the last push received: resume after it

    def __iter__(self) -> FinishedStream:
        return self

    def __next__(self) -> Finished:
        try:
            r = next(self._call)  # type: ignore[call-overload]
        except grpc.RpcError as e:
            raise from_code(e.code().name, e.details() or "") from None
        self.last_seq = r.seq
        return _finished_from_pb(r)

    def cancel(self) -> None:
        self._call.cancel()
