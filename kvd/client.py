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
import functools
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from kvd.auth import WORKER_TOKEN_HEADER, AuthConfig
from kvd.convert import worker_to_pb
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


@dataclass
class Finished:
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    details: dict[tuple[str, str], pb.FinishedDetail] = field(default_factory=dict)

    def merge(self, other: Finished) -> None:
        self.finished_sending |= other.finished_sending
        self.finished_recving |= other.finished_recving
        self.invalid_block_ids |= other.invalid_block_ids
        self.details.update(other.details)


def _finished(r: pb.GetFinishedResponse) -> Finished:
    return Finished(set(r.finished_sending), set(r.finished_recving), set(r.invalid_block_ids), {(d.direction, d.request_id): d for d in r.details})


def daemon_status(address: str, auth: AuthConfig | None = None, timeout: float = 30.0, *, wait_ready: bool = True) -> pb.StatusResponse:
    """The daemon's Admin.Status (its engine id, epoch, workers, leases, ...);
    with ``wait_ready``, waiting up to ``timeout`` for it to come up."""
    auth = auth or AuthConfig()
    creds = auth.channel_credentials()
    channel = grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)
    try:
        if wait_ready:
            grpc.channel_ready_future(channel).result(timeout=timeout)
        return pbg.AdminStub(channel).Status(pb.StatusRequest(), timeout=timeout, metadata=auth.call_metadata())
    except grpc.FutureTimeoutError:
        raise DeadlineExceeded(f"kvd daemon at {address} not reachable after {timeout}s") from None
    except grpc.RpcError as e:
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
        options = [("grpc.max_send_message_length", 16 << 20), ("grpc.max_receive_message_length", 16 << 20)]
        creds = self.auth.channel_credentials()
        self._channel = grpc.secure_channel(address, creds, options=options) if creds else grpc.insecure_channel(address, options=options)
        self._worker = pbg.WorkerStub(self._channel)
        self._wid = worker_to_pb(worker)
        self.worker_token = b""  # issued by register(); proves we are this worker
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
        from kvd.caches import describe

        described = describe(groups, dims=dims, kinds=kinds)  # type: ignore[arg-type]
        resp = self._call(self._worker.Register, pb.RegisterRequest(
            worker=self._wid, model=pb.ModelInfo(num_layers=model.num_layers, total_num_kv_heads=model.total_num_kv_heads),
            regions=described.regions, groups=described.groups,
        ))
        self.worker_token = resp.worker_token
        return resp

    def publish(self, request_id: str, block_ids: Sequence[Sequence[int]], num_tokens: int, *, capability: bytes = b"", reader_engine_id: str = "",
                lease_seconds: float = 0.0, first_tokens: Sequence[int] = (), stream: bool = False) -> pb.TransferParams:
        """Offer this worker's blocks of ``request_id``, per group; a group's
        ids hold the tokens from its ``first_tokens`` entry on (0 if none).
        ``stream``: offered before they are computed (layer-wise streaming);
        each layer is served once ``layers_saved`` says it is written."""
        resp = self._call(self._worker.Publish, pb.PublishRequest(
            worker=self._wid, request_id=request_id, block_ids=_block_ids(block_ids, first_tokens),
            num_tokens=num_tokens, capability=capability, reader_engine_id=reader_engine_id, lease_seconds=lease_seconds,
            stream=stream,
        ))
        return resp.params

    def publish_engine(self, request_id: str, block_ids: Sequence[Sequence[int]], num_tokens: int, *, capability: bytes = b"",
                       reader_engine_id: str = "", lease_seconds: float = 0.0, first_tokens: Sequence[int] = ()) -> pb.TransferParams:
        """Offer ``request_id``'s blocks on every rank of this engine at once
        (the engine's scheduler, with a registered worker's ``worker_token``);
        refused unless every rank is registered with this daemon."""
        resp = self._call(self._worker.PublishEngine, pb.PublishEngineRequest(
            engine_id=self.worker.engine_id, request_id=request_id, block_ids=_block_ids(block_ids, first_tokens),
            num_tokens=num_tokens, capability=capability, reader_engine_id=reader_engine_id, lease_seconds=lease_seconds,
        ))
        return resp.params

    def layers_saved(self, request_ids: Sequence[str], layers_saved: int, *, wait: bool = False) -> None:
        """Layer-wise streaming: every model layer below ``layers_saved`` of
        these streaming publications is written on this rank. Sent without
        waiting (prefill must never wait on the network); a call the daemon
        refused raises from a later one, or from ``flush_saves``."""
        req = pb.LayersSavedRequest(worker=self._wid, request_ids=list(request_ids), layers_saved=layers_saved)
        if wait:
            self._call(self._worker.LayersSaved, req)
        else:
            self._saves.append(self._worker.LayersSaved.future(req, timeout=self.timeout, metadata=self._metadata()))
        self._check_saves(block=False)  # after sending: an earlier refusal must not lose this save

    def flush_saves(self) -> None:
        """Wait for every ``layers_saved`` sent so far; raise the first refusal."""
        self._check_saves(block=True)

    def _check_saves(self, *, block: bool) -> None:
        while self._saves and (block or self._saves[0].done()):
            f = self._saves.popleft()
            try:
                f.result()
            except grpc.RpcError as e:
                raise from_code(e.code().name, e.details() or "") from None

    def pull(self, request_id: str, params: pb.TransferParams, local_block_ids: Sequence[Sequence[int]], *, first_tokens: Sequence[int] = ()) -> None:
        """Read ``params``' blocks into ours, per group from its ``first_tokens``
        entry on (0 if none); each group moves only what decode needs of it."""
        self._call(self._worker.Pull, pb.PullRequest(
            worker=self._wid, request_id=request_id, params=params, local_block_ids=_block_ids(local_block_ids, first_tokens),
        ))

    def pull_nowait(self, request_id: str, params: pb.TransferParams, local_block_ids: Sequence[Sequence[int]], *,
                    first_tokens: Sequence[int] = (), answered: Callable[[KvdError | None], None]) -> None:
        """``pull`` without waiting for the daemon's answer: ``answered`` is
        called (on a gRPC thread) with None once the daemon accepted it, or
        with why it did not. The caller (a thread an engine step hands its
        loads to) goes on at once, and a daemon slow to answer (busy, or
        stuck) holds nothing up: the load fails at the call's timeout."""
        future = self._worker.Pull.future(pb.PullRequest(
            worker=self._wid, request_id=request_id, params=params, local_block_ids=_block_ids(local_block_ids, first_tokens),
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
        return _finished(self._call(self._worker.GetFinished, pb.GetFinishedRequest(worker=self._wid)))

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
        return _finished(r)

    def watch_engine_finished(self) -> Iterator[Finished]:
        """Yields the engine's merged sets as requests complete (a server stream)."""
        stream = self._worker.WatchEngineFinished(pb.EngineFinishedRequest(engine_id=self.worker.engine_id), metadata=self._metadata())
        try:
            for r in stream:
                yield _finished(r)
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
        return _finished(r)

    def cancel(self) -> None:
        self._call.cancel()


class FinishedFeed:
    """A worker's finished sets, pushed by its daemon and gathered by a
    background thread, so an engine step reads them (``take``) without a round
    trip.

    A stream that breaks is reopened, up to ``reconnect_attempts`` times in a
    row with a doubling pause, resuming after the last push received: the
    daemon resends what the break may have lost, and what it emitted
    meanwhile waited in the worker's box, so nothing is lost. A daemon that
    stays away, or refuses the stream (the worker is no longer registered
    with it: it restarted), sets ``error`` and stops the thread.
    """

    def __init__(self, client: KvdClient, *, reconnect_attempts: int = 5, backoff_seconds: float = 0.05,
                 on_error: Callable[[FinishedFeed, KvdError], None] | None = None) -> None:
        self._client = client
        self._on_error = on_error  # called from the feed's thread, with this feed, once ``error`` is set
        self._reconnect_attempts = reconnect_attempts
        self._backoff_seconds = backoff_seconds
        self._cond = threading.Condition()  # guards _pending, _error, _stream
        self._pending = Finished()
        self._error: KvdError | None = None
        self._stream: FinishedStream | None = None
        self._stop = threading.Event()
        self.subscribed = threading.Event()  # the first stream's backlog arrived
        self._thread = threading.Thread(target=self._run, name=f"kvd-finished-{client.worker.tp_rank}-{client.worker.pp_rank}", daemon=True)

    def start(self) -> FinishedFeed:
        self._thread.start()
        return self

    @property
    def error(self) -> KvdError | None:
        """Why the feed stopped (the daemon went away), or None while it runs.
        Read it before ``take``: everything received before it was set is then
        in what ``take`` returns."""
        return self._error

    def take(self) -> Finished:
        """What arrived since the last take (no RPC: swaps the gathered sets)."""
        with self._cond:
            out, self._pending = self._pending, Finished()
        return out

    def wait_finished(self, recving: set[str] = frozenset(), sending: set[str] = frozenset(), timeout: float = 60.0) -> Finished:  # type: ignore[assignment]
        """Take until every id in ``recving``/``sending`` arrived; returns all taken."""
        seen = Finished()
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                seen.merge(self._pending)
                self._pending = Finished()
                if recving <= seen.finished_recving and sending <= seen.finished_sending:
                    return seen
                if self._error is not None:
                    raise self._error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeadlineExceeded(f"not pushed after {timeout}s: recving={sorted(recving - seen.finished_recving)[:5]} sending={sorted(sending - seen.finished_sending)[:5]}")
                self._cond.wait(left)

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds until something is pending to take
        (or the feed failed); whether it is."""
        with self._cond:
            def ready() -> bool:
                p = self._pending
                return bool(p.finished_sending or p.finished_recving or p.invalid_block_ids) or self._error is not None

            return self._cond.wait_for(ready, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Cancel the stream and join the thread; what was gathered stays takeable."""
        self._stop.set()
        with self._cond:
            stream = self._stream
        if stream is not None:
            stream.cancel()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        failures = 0
        resume_after: int | None = None  # a new subscription first, then resumed
        while True:
            with self._cond:
                # Checked under the lock close() takes: it either sees this stream or we see the stop.
                if self._stop.is_set():
                    return
                stream = self._stream = self._client.watch_finished(resume_after)
            try:
                for f in stream:
                    failures = 0  # the daemon answered: a later break starts a fresh count
                    with self._cond:
                        self._pending.merge(f)
                        self._cond.notify_all()
                    self.subscribed.set()
                # A clean end: the daemon ended our registration's stream; reopening tells why.
                why: KvdError = Unavailable("the daemon ended the finished stream")
            except KvdError as e:
                why = e
            resume_after = stream.last_seq
            if self._stop.is_set():
                return
            failures += 1
            # Only a lost connection may heal; a refusal (not registered, bad token) will not.
            if not isinstance(why, Unavailable | DeadlineExceeded) or failures > self._reconnect_attempts:
                with self._cond:
                    self._error = why
                    self._cond.notify_all()
                if self._on_error is not None:
                    self._on_error(self, why)
                return
            if self._stop.wait(self._backoff_seconds * 2 ** (failures - 1)):
                return


def _block_ids(block_ids: Sequence[Sequence[int]], first_tokens: Sequence[int]) -> list[pb.BlockIds]:
    return [pb.BlockIds(ids=list(b), first_token=first_tokens[g] if g < len(first_tokens) else 0) for g, b in enumerate(block_ids)]


class AfterDevice:
    """Calls an engine step makes of the daemon from inside its forward,
    each run on this thread, in order, once the device has done what the
    step enqueued before it (a CUDA event recorded on the compute stream
    when the caches are on a GPU; at once on host caches), so the forward
    never waits on the daemon or the device. A streaming prefill says its
    layers saved (``saved``); a decode starts its loads after vLLM's zeroing
    of the blocks they land in (``run``)."""

    def __init__(self, client: KvdClient, num_layers: int, *, cuda: bool = False) -> None:
        import queue

        # cuda: the caches are on a GPU; each call waits for the compute stream to get there.
        self.client, self.num_layers, self.cuda = client, num_layers, cuda
        self.error: KvdError | None = None  # the last refused save, for the engine's log
        self._queue: queue.SimpleQueue[tuple[Callable[[], None], Any] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvd-after-device", daemon=True)
        self._thread.start()

    def run(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once the current stream has reached this point."""
        event = None
        if self.cuda:
            import torch

            event = torch.cuda.Event()
            event.record()
        self._queue.put((fn, event))

    def saved(self, names: Sequence[str], layers_saved: int) -> None:
        """Every layer below ``layers_saved`` of ``names`` is written, or (on
        a GPU) will be once the current stream reaches this point."""
        self.run(functools.partial(self._say_saved, list(names), layers_saved))

    def _say_saved(self, names: list[str], upto: int) -> None:
        try:
            self.client.layers_saved(names, upto)
        except KvdError as e:  # an earlier save was refused; its read fails at layer_wait_seconds
            self.error = e

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, event = item
            if event is not None:
                event.synchronize()
            fn()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
