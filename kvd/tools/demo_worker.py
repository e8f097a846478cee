"""One engine rank of ``kvd demo`` and the stream bench, as a process.

The rank owns its KV caches in shared memory (attention, and Mamba2 state
parts for a hybrid), registers them with its daemon and obeys the driver's
commands over a pipe: publish (or stream, computing one layer at a time),
pull, verify, finished.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from kvd.core.groups import FULL_ATTENTION, SLIDING_WINDOW, STATE_PART, GroupKind
from kvd.core.spec import CPU_ATTENTION_PARTS, KVCacheSpec, ModelInfo, WorkerId, parse_layout
from kvd.core.topology import heads_of_rank
from kvd.state_parts import SD, StateShape, mamba2


@dataclass(frozen=True)
class EngineConfig:
    engine_id: str
    tp: int
    pp: int
    block_size: int
    layout: str
    num_blocks: int
    conv_layout: str = SD  # the Mamba2 layers' conv state: SD (state_len, conv_dim) or DS


@dataclass(frozen=True)
class ModelConfig:
    layers: int
    kv_heads: int
    head_size: int
    dtype: str
    mla: bool
    # A hybrid: every ``full_every``-th layer full attention, the others on a
    # window of ``sliding_window`` tokens (0: all full attention).
    sliding_window: int = 0
    full_every: int = 2
    # Mamba2 layers: every ``mamba_every``-th layer from layer 0 (1: all of
    # them, a pure Mamba2 model; 0: none), each moved as its state parts.
    mamba_every: int = 0

    def kind_of(self, layer: int) -> GroupKind:
        if self.mamba_every and layer % self.mamba_every == 0:
            return STATE_PART
        if self.sliding_window and layer % self.full_every != self.full_every - 1:
            return GroupKind(SLIDING_WINDOW, self.sliding_window)
        return FULL_ATTENTION

    def groups(self, layers: Sequence[int]) -> list[tuple[GroupKind, list[int]]]:
        """The KV cache groups of ``layers``, full attention first."""
        kinds = sorted({self.kind_of(i) for i in layers}, key=lambda k: (k.is_state, k.name != "full", k.window))
        return [(k, [i for i in layers if self.kind_of(i) == k]) for k in kinds]

    @property
    def attention_heads(self) -> int:
        """The model's KV heads; 0 when every layer is a Mamba2 layer."""
        return 0 if self.mamba_every == 1 else self.kv_heads

    def state_shape(self, conv_layout: str) -> StateShape:
        """The Mamba2 layers' state: twice the KV heads of SSM heads, a group per KV head."""
        return mamba2(num_heads=2 * self.kv_heads, head_dim=self.head_size, n_groups=self.kv_heads, d_state=16, conv_kernel=4,
                      dtype=self.dtype, ssm_dtype="float32", conv_layout=conv_layout)


def kept_from(kind: GroupKind, num_tokens: int, block_size: int) -> int:
    """The first token of a group's blocks that an engine keeps for a prompt:
    the blocks wholly before what decode needs are freed (vLLM makes them
    null blocks), on both sides."""
    return kind.first_needed_block_token(num_tokens, block_size)


def rank_spec(engine: EngineConfig, model: ModelConfig, tp_rank: int) -> KVCacheSpec:
    heads = heads_of_rank(tp_rank, engine.tp, model.kv_heads, model.mla)
    layout = parse_layout(engine.layout)
    opaque = "span" in layout
    return KVCacheSpec(
        block_size=engine.block_size, num_kv_heads=heads.count, head_size=model.head_size, dtype=model.dtype,
        layout=layout, num_blocks=engine.num_blocks, use_mla=model.mla,
        span_size=2 * engine.block_size * model.head_size if opaque else 0,
    )


def allocate_engine_caches(engine: EngineConfig, spec: KVCacheSpec, names: list[str]) -> tuple[dict[str, Any], Any]:
    """The rank's caches in shm, and the dims to register them with: vLLM's CPU
    attention tensors (K and V as strided parts) for layout CPU, else tensors
    in the spec's layout order."""
    from kvd.caches import allocate_cpu_attention_caches, allocate_kv_caches, cpu_attention_parts

    if engine.layout.upper() == "CPU":
        full = allocate_cpu_attention_caches(spec, names)
        return {n: cpu_attention_parts(t) for n, t in full.items()}, CPU_ATTENTION_PARTS
    return dict(allocate_kv_caches(spec, names)), None


def stage_layers(model: ModelConfig, pp: int, pp_rank: int) -> list[int]:
    per = -(-model.layers // pp)
    return list(range(pp_rank * per, min(model.layers, (pp_rank + 1) * per)))


# ---------------------------------------------------------------- worker process


def worker_main(address: str, worker: WorkerId, engine: EngineConfig, model: ModelConfig, conn: Connection) -> None:
    """One engine rank: owns its caches in shm, obeys the driver's commands."""
    import torch

    from kvd.caches import allocate_state_pages, local_group_tensors, release_all
    from kvd.client import FinishedFeed, KvdClient
    from kvd.testing import pattern

    torch.set_num_threads(1)
    try:
        try:
            spec = rank_spec(engine, model, worker.tp_rank)
            groups = model.groups(stage_layers(model, worker.pp_size, worker.pp_rank))
            registered, tensors, kinds, specs, coords = [], [], [], [], []
            dims = None
            attention_coords = pattern.RankCoords.of(worker.tp_rank, worker.tp_size, model.kv_heads, model.mla)
            for kind, layers in groups:
                if kind.is_state:
                    # One page per Mamba2 layer and block; each of its parts is a group of its own.
                    state = model.state_shape(engine.conv_layout)
                    pages = allocate_state_pages([f"model.layers.{i}.mixer" for i in layers], engine.num_blocks, state.page_bytes(worker.tp_size) + 64)
                    for pspec, caches in state.layer_parts(pages, worker.tp_size):
                        registered.append((pspec, caches))
                        tensors.append(local_group_tensors(pspec, caches))
                        kinds.append(kind)
                        specs.append(pspec)
                        coords.append(pattern.RankCoords(worker.tp_rank * pspec.num_kv_heads))
                    continue
                caches, dims = allocate_engine_caches(engine, spec, [f"model.layers.{i}.self_attn.attn" for i in layers])
                registered.append((spec, caches))
                tensors.append(local_group_tensors(spec, caches, dims=dims))
                kinds.append(kind)
                specs.append(spec)
                coords.append(attention_coords)
            client = KvdClient(address, worker)
            client.wait_ready()
            client.register(registered, ModelInfo(model.layers, model.attention_heads), dims=dims, kinds=kinds)
            # Every group takes the request's blocks from one pool, each group
            # its share of them (from the token it keeps on): as in vLLM. A
            # state group keeps one block, the request's running state.
            def own(ids: list[int], ntok: int, kind: GroupKind) -> tuple[int, list[int]]:
                if kind.is_state:
                    return 0, ids[-1:]
                first = kept_from(kind, ntok, spec.block_size)
                return first, ids[first // spec.block_size :]
        except Exception as e:  # the driver says why this rank could not start
            conn.send(("error", f"{worker}: {type(e).__name__}: {getattr(e, 'message', e)}"))
            return
        conn.send(("ready", None))
        feed: FinishedFeed | None = None
        while True:
            cmd, arg = conn.recv()
            if cmd == "stop":
                break
            try:
                if cmd == "publish":  # [(rid, seed, block_ids, num_tokens, capability)]
                    out = []
                    for rid, seed, ids, ntok, cap in arg:
                        mine = [own(ids, ntok, kind) for kind in kinds]
                        for t, c, (first, g_ids) in zip(tensors, coords, mine, strict=True):
                            pattern.fill(t, seed, g_ids, c, first_token=first)
                        out.append(client.publish(rid, [g for _, g in mine], ntok, capability=cap,
                                                  first_tokens=[f for f, _ in mine]))
                    conn.send(("ok", out))
                elif cmd == "prefill":  # ([(rid, seed, block_ids, num_tokens, capability)], seconds per layer, Prefill)
                    reqs, layer_s, how = arg
                    prefill(client, conn, reqs, [[own(ids, ntok, kind) for kind in kinds] for _, _, ids, ntok, _ in reqs],
                            tensors, coords, stage_layers(model, worker.pp_size, worker.pp_rank), layer_s, how)
                elif cmd == "pull":  # [(rid, params, local ids, tenant)]
                    if feed is None:  # pushed outcomes: the time a pull landed is not a poll's
                        feed = FinishedFeed(client).start()
                        if not feed.subscribed.wait(30):
                            raise RuntimeError(f"{worker}: the daemon's finished stream did not start within 30 s")
                    t0 = time.perf_counter()
                    for rid, params, ids, tenant in arg:
                        mine = [own(ids, params.num_tokens, kind) for kind in kinds]
                        client.pull(rid, params, [g for _, g in mine], first_tokens=[f for f, _ in mine], tenant=tenant)
                    done = feed.wait_finished(recving={rid for rid, *_ in arg}, timeout=120)
                    elapsed = time.perf_counter() - t0
                    nbytes = sum(d.bytes for (direction, _), d in done.details.items() if direction == "recving")
                    failed = {r: d.reason for (direction, r), d in done.details.items() if direction == "recving" and d.outcome != "done"}
                    conn.send(("ok", (elapsed, nbytes, failed, sorted(done.invalid_block_ids), time.monotonic())))
                elif cmd == "verify":  # [(rid, seed, local ids, num_tokens)]
                    bad = None
                    for rid, seed, ids, ntok in arg:
                        for gi, (t, c, kind) in enumerate(zip(tensors, coords, kinds, strict=True)):
                            if kind.is_state:  # the running state, every row
                                m = pattern.mismatch(t, seed, ids[-1:], c, specs[gi].block_size)
                            else:  # what decode needs of the group, from its first whole block
                                first = kind.first_needed_block_token(ntok, spec.block_size)
                                m = pattern.mismatch(t, seed, ids[first // spec.block_size :], c, ntok, first_token=first)
                            if m is not None:
                                bad = f"request {rid} on {worker}, group {gi} ({kind}): {m}"
                                break
                        if bad:
                            break
                    conn.send(("ok", bad))
                elif cmd == "finished":
                    f = client.get_finished()
                    conn.send(("ok", (sorted(f.finished_sending), sorted(f.finished_recving))))
            except Exception as e:
                conn.send(("error", f"{type(e).__name__}: {e}"))
        if feed is not None:
            feed.close()
        client.close()
    except (BrokenPipeError, EOFError):
        pass  # the driver is gone (or gave up on us): nobody to answer
    finally:
        release_all()


# What a block held before this prompt (another request's KV): a layer
# served before prefill saved it would show as this seed, never silently.
STALE = 0x5A5A5


@dataclass(frozen=True)
class Prefill:
    """How a bench or demo prefill runs: ``stream`` publishes first and says
    each layer saved (else it publishes once all are written: pull mode);
    ``busy`` computes on every core (torch's threads) instead of sleeping,
    as a real prefill's forward does, so a transfer shares the cores with
    it; ``publish`` False computes alone (the compute-only baseline)."""

    stream: bool = False
    busy: bool = False
    publish: bool = True


class Burner:
    """A forward's fixed work on every core: matrix products on torch's
    threads (the GIL released, as in a forward). Calibrated once, on an idle
    machine, to how many products take a given time; a layer then does that
    many, so a transfer that takes cores from it makes it take longer, as it
    would a real prefill (a wall-clock loop would hide that)."""

    def __init__(self) -> None:
        import torch

        self._a = torch.ones(128, 128)
        torch.mm(self._a, self._a)
        n, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < 0.2:
            torch.mm(self._a, self._a)
            n += 1
        self._per_second = n / elapsed

    def run(self, seconds: float) -> None:
        import torch

        for _ in range(max(1, round(seconds * self._per_second))):
            torch.mm(self._a, self._a)


_BURNER: Burner | None = None  # one per rank process, calibrated before its first busy prefill starts


def prefill(client: Any, conn: Connection, reqs: Sequence[Any], mine: Sequence[Sequence[tuple[int, list[int]]]], tensors: Sequence[Any],
            coords: Sequence[Any], layers: Sequence[int], layer_s: float, how: Prefill) -> None:
    """Prefill computes the requests one layer at a time (``layer_s`` a
    layer), writing each layer's KV as it goes, and publishes as ``how``
    says. Answers the params (nothing when it does not publish), then when
    it started and when its last layer was done (``time.monotonic``: one
    clock for every process on the host)."""
    import os

    import torch

    from kvd.testing import pattern

    for (_rid, seed, *_), groups in zip(reqs, mine, strict=True):
        for t, c, (first, ids) in zip(tensors, coords, groups, strict=True):
            pattern.fill(t, seed ^ STALE, ids, c, first_token=first)

    def publish() -> list[Any]:  # the daemon's params, as the pipe pickles them
        return [client.publish(rid, [g for _, g in groups], ntok, capability=cap, first_tokens=[f for f, _ in groups],
                               stream=how.stream) for (rid, _s, _i, ntok, cap), groups in zip(reqs, mine, strict=True)]

    streaming = how.stream and how.publish
    global _BURNER
    if how.busy:
        torch.set_num_threads(os.cpu_count() or 1)
        _BURNER = _BURNER or Burner()
    try:
        started = time.monotonic()
        if streaming:
            conn.send(("ok", publish()))
        for layer in layers:
            if _BURNER is not None and how.busy:
                _BURNER.run(layer_s)
            else:
                time.sleep(layer_s)
            for (_rid, seed, *_), groups in zip(reqs, mine, strict=True):
                for t, c, (first, ids) in zip(tensors, coords, groups, strict=True):
                    if layer in t.layer_indices:
                        pattern.fill(t, seed, ids, c, first_token=first, positions=[t.layer_indices.index(layer)])
            if streaming:
                client.layers_saved([r[0] for r in reqs], layer + 1)
        computed = time.monotonic()
    finally:
        torch.set_num_threads(1)
    if streaming:
        client.flush_saves()
    else:
        conn.send(("ok", publish() if how.publish else []))
    conn.send(("ok", (started, computed)))
