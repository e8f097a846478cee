"""``kvd demo``: a real P/D transfer on loopback, every byte verified.

Starts a prefill daemon and a decode daemon (``kvd serve`` processes), one
worker process per rank on each side with KV caches in shared memory, then
moves a few hundred requests of varying lengths and checks every valid token
of every block on the decode side against the logical pattern.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import secrets
import subprocess
import sys
import tempfile
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
    from kvd.client import KvdClient
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
                                                  first_tokens=[f for f, _ in mine]).SerializeToString())
                    conn.send(("ok", out))
                elif cmd == "pull":  # [(rid, params bytes, local ids)]
                    from kvd.proto import kvd_pb2 as pb

                    t0 = time.perf_counter()
                    for rid, raw, ids in arg:
                        params = pb.TransferParams.FromString(raw)
                        mine = [own(ids, params.num_tokens, kind) for kind in kinds]
                        client.pull(rid, params, [g for _, g in mine], first_tokens=[f for f, _ in mine])
                    done = client.wait_finished(recving={rid for rid, _, _ in arg}, timeout=120)
                    elapsed = time.perf_counter() - t0
                    nbytes = sum(d.bytes for (direction, _), d in done.details.items() if direction == "recving")
                    failed = {r: d.reason for (direction, r), d in done.details.items() if direction == "recving" and d.outcome != "done"}
                    conn.send(("ok", (elapsed, nbytes, failed, sorted(done.invalid_block_ids))))
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
        client.close()
    except (BrokenPipeError, EOFError):
        pass  # the driver is gone (or gave up on us): nobody to answer
    finally:
        release_all()


# ---------------------------------------------------------------- driver


class Daemons:
    """``kvd serve`` subprocesses with ready files."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.tmp = tempfile.mkdtemp(prefix="kvd-demo-")

    def start(self, engine_id: str, extra: Sequence[str] = ()) -> dict[str, Any]:
        """Start ``kvd serve``; ``extra`` are more flags."""
        ready = os.path.join(self.tmp, f"{engine_id}.json")
        log = open(os.path.join(self.tmp, f"{engine_id}.log"), "wb")  # noqa: SIM115 - the child keeps it
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvd", "serve", "--engine-id", engine_id, "--grpc-port", "0", "--data-port", "0", "--metrics-port", "0", "--ready-file", ready, *extra],
            stdout=log, stderr=subprocess.STDOUT,
        )
        self.procs.append(proc)
        deadline = time.monotonic() + 60
        while not os.path.exists(ready):
            if proc.poll() is not None:
                raise SystemExit(f"kvd serve for {engine_id} exited with {proc.returncode}; see {log.name}")
            if time.monotonic() > deadline:
                raise SystemExit(f"kvd serve for {engine_id} did not become ready; see {log.name}")
            time.sleep(0.05)
        with open(ready) as f:
            return dict(json.load(f))

    def stop(self) -> list[int]:
        for p in self.procs:
            p.terminate()
        return [p.wait(timeout=30) for p in self.procs]


class Allocator:
    """A free list; popping from it and pushing back fragments it like a real block pool."""

    def __init__(self, num_blocks: int, rng: random.Random) -> None:
        self.free = list(range(1, num_blocks))  # block 0 is reserved, as in vLLM
        rng.shuffle(self.free[len(self.free) // 2 :])
        self.rng = rng

    def take(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        out, self.free = self.free[:n], self.free[n:]
        return out

    def give(self, ids: list[int]) -> None:
        self.free.extend(ids)


def _call(conns: Sequence[Connection], cmd: str, args: Sequence[Any]) -> list[Any]:
    for c, a in zip(conns, args, strict=True):
        c.send((cmd, a))
    out = []
    for c in conns:
        status, value = c.recv()
        if status != "ok":
            raise RuntimeError(value)
        out.append(value)
    return out


def run_demo(args: argparse.Namespace) -> int:
    model = ModelConfig(args.layers, args.kv_heads, args.head_size, args.dtype, args.mla, args.sliding_window, args.full_every, args.mamba_every)
    if args.mamba_every and args.mla:
        raise SystemExit("--mamba-every and --mla do not combine")
    p_conv, _, d_conv = args.conv_layouts.upper().partition(",")
    default_layout = "MLA" if args.mla else "NHD"
    pcfg = EngineConfig("prefill", args.prefill_tp, args.prefill_pp, args.prefill_block_size or args.block_size, args.prefill_layout or default_layout, args.num_blocks, p_conv)
    dcfg = EngineConfig("decode", args.decode_tp, args.decode_pp, args.decode_block_size or args.block_size, args.decode_layout or default_layout, args.num_blocks * max(1, pcfg.block_size // (args.decode_block_size or args.block_size)))
    # Decode blocks must hold as many tokens as prefill's.
    dcfg = EngineConfig(dcfg.engine_id, dcfg.tp, dcfg.pp, dcfg.block_size, dcfg.layout, max(2, args.num_blocks * pcfg.block_size // dcfg.block_size + 1),
                        d_conv or p_conv)
    if args.sliding_window and dcfg.block_size > pcfg.block_size:
        # P keeps a window from one of its blocks; a bigger decode block there would be part filled.
        raise SystemExit("--sliding-window needs decode blocks no larger than prefill's")
    rng = random.Random(args.seed)
    say = print
    say(f"kvd demo ({args.transport}): prefill TP{pcfg.tp}/PP{pcfg.pp} block {pcfg.block_size} {pcfg.layout} -> decode TP{dcfg.tp}/PP{dcfg.pp} block {dcfg.block_size} {dcfg.layout}; "
        f"{model.layers} layers, {model.kv_heads} KV heads x {model.head_size} {model.dtype}{' MLA' if model.mla else ''}"
        + (f"; every {model.full_every}th layer full attention, the others a {model.sliding_window}-token window" if model.sliding_window else "")
        + (f"; every {model.mamba_every}th layer Mamba2 (conv {pcfg.conv_layout} -> {dcfg.conv_layout})" if model.mamba_every else ""))
    daemons = Daemons()
    ctx = mp.get_context("spawn")
    procs: list[Any] = []
    pipes: list[Connection] = []  # the driver's end of every worker's pipe
    try:
        same_host = ["--same-host", "auto" if args.transport == "samehost" else "off"]
        if args.transport == "nixl":
            same_host += ["--transport", "nixl"]
        # Existing daemons (docker-compose, a cluster) or our own.
        p_info = {"grpc": args.prefill_address, "data": "(theirs)"} if args.prefill_address else daemons.start("prefill", same_host)
        d_info = {"grpc": args.decode_address, "data": "(theirs)"} if args.decode_address else daemons.start("decode", same_host)
        say(f"  daemons: prefill grpc={p_info['grpc']} data={p_info['data']}  decode grpc={d_info['grpc']} data={d_info['data']}")
        sides: dict[str, list[Connection]] = {}
        for engine, info in ((pcfg, p_info), (dcfg, d_info)):
            conns = []
            for pp in range(engine.pp):
                for tp in range(engine.tp):
                    parent, child = ctx.Pipe()
                    w = WorkerId(engine.engine_id, tp, engine.tp, pp, engine.pp)
                    proc = ctx.Process(target=worker_main, args=(info["grpc"], w, engine, model, child), daemon=True)
                    proc.start()
                    procs.append(proc)
                    pipes.append(parent)
                    conns.append(parent)
            for c in conns:
                if not c.poll(120):
                    raise SystemExit("a worker did not start within 120 s")
                status, value = c.recv()
                if status != "ready":
                    raise SystemExit(f"worker failed to start: {value}")
            sides[engine.engine_id] = conns
        say(f"  workers: {len(sides['prefill'])} prefill, {len(sides['decode'])} decode, caches in shared memory")
        p_alloc, d_alloc = Allocator(pcfg.num_blocks, rng), Allocator(dcfg.num_blocks, rng)
        total_bytes = 0
        total_blocks = 0
        transfer_s = 0.0
        failures: dict[str, str] = {}
        first_mismatch: str | None = None
        done = 0
        t_start = time.perf_counter()
        while done < args.requests:
            batch: list[tuple[str, int, int, list[int], list[int], bytes]] = []
            for _ in range(min(args.concurrency, args.requests - done)):
                ntok = rng.randint(args.min_tokens, args.max_tokens)
                p_ids = p_alloc.take(-(-ntok // pcfg.block_size))
                d_ids = d_alloc.take(-(-ntok // dcfg.block_size))
                if p_ids is None or d_ids is None:
                    if p_ids:
                        p_alloc.give(p_ids)
                    if d_ids:
                        d_alloc.give(d_ids)
                    break
                rid = f"req-{done + len(batch)}"
                batch.append((rid, rng.randrange(1 << 20), ntok, p_ids, d_ids, secrets.token_bytes(32)))
            if not batch:
                raise SystemExit("the block pools are too small for one request; raise --num-blocks")
            published = _call(sides["prefill"], "publish", [[(rid, seed, p, n, cap) for rid, seed, n, p, _d, cap in batch]] * len(sides["prefill"]))
            params = published[0]
            results = _call(sides["decode"], "pull", [[(b[0], params[i], b[4]) for i, b in enumerate(batch)]] * len(sides["decode"]))
            transfer_s += max(r[0] for r in results)
            total_bytes += sum(r[1] for r in results)
            for r in results:
                failures.update(r[2])
            total_blocks += sum(len(b[4]) for b in batch)
            if first_mismatch is None:
                verdicts = _call(sides["decode"], "verify", [[(rid, seed, d, n) for rid, seed, n, _p, d, _c in batch if rid not in failures]] * len(sides["decode"]))
                first_mismatch = next((v for v in verdicts if v), None)
            for b in batch:
                p_alloc.give(b[3])
                d_alloc.give(b[4])
            done += len(batch)
            _progress(done, args.requests, total_bytes, transfer_s)
        wall = time.perf_counter() - t_start
        # Every prefill rank must report every request as sent (its blocks freed).
        sent: list[set[str]] = [set() for _ in sides["prefill"]]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for box, (s, _r) in zip(sent, _call(sides["prefill"], "finished", [None] * len(sides["prefill"])), strict=True):
                box.update(s)
            if all(len(box) >= args.requests - len(failures) for box in sent):
                break
            time.sleep(0.05)
        sent_everywhere = set.intersection(*sent) if sent else set()
        print()
        gbps = total_bytes / transfer_s / 1e9 if transfer_s else 0.0
        say("kvd demo summary")
        say(f"  requests       {args.requests}")
        say(f"  blocks         {total_blocks} decode blocks")
        say(f"  bytes          {total_bytes / 1e6:.1f} MB")
        say(f"  throughput     {gbps:.2f} GB/s (bytes / time from pull to finished_recving)")
        say(f"  wall time      {wall:.1f} s (including filling and verifying)")
        say(f"  failures       {len(failures)}" + (f" (first: {next(iter(failures.values()))})" if failures else ""))
        say(f"  finished_sending reported by all {len(sent)} prefill ranks for {len(sent_everywhere)} of {args.requests} requests")
        ok = first_mismatch is None and not failures and len(sent_everywhere) >= args.requests
        if first_mismatch:
            say(f"  MISMATCH       {first_mismatch}")
        elif ok:
            say("  verified       every valid token of every block matches, byte for byte")
        for c in (*sides.get("prefill", []), *sides.get("decode", [])):
            c.send(("stop", None))
        for p in procs:
            p.join(timeout=10)
        codes = daemons.stop()
        if any(codes):
            say(f"  daemons exited with {codes}")
            ok = False
        return 0 if ok else 1
    finally:
        # Closing a worker's pipe ends it through its own finally, which unlinks
        # its shm caches; a killed worker would leave them in /dev/shm.
        for c in pipes:
            c.close()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        for p in daemons.procs:
            if p.poll() is None:
                p.kill()


def _progress(done: int, total: int, nbytes: int, seconds: float) -> None:
    width = 30
    filled = width * done // total
    rate = nbytes / seconds / 1e9 if seconds else 0.0
    line = f"  [{'#' * filled}{'.' * (width - filled)}] {done}/{total} requests  {nbytes / 1e6:8.1f} MB  {rate:5.2f} GB/s"
    if sys.stdout.isatty():
        print("\r" + line, end="", flush=True)
    elif done == total or done % max(1, total // 10) < 16:
        print(line, flush=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight per batch")
    p.add_argument("--min-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--mla", action="store_true")
    p.add_argument("--sliding-window", type=int, default=0, help="a hybrid model: layers on a window of this many tokens (0: none)")
    p.add_argument("--full-every", type=int, default=2, help="with --sliding-window: every Nth layer is full attention")
    p.add_argument("--mamba-every", type=int, default=0, help="a Mamba2 hybrid: every Nth layer from layer 0 is a Mamba2 layer (1: pure Mamba2; 0: none)")
    p.add_argument("--conv-layouts", default="SD,SD", help="the Mamba2 conv state's layout on prefill,decode: SD or DS each")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=2048, help="prefill blocks per rank")
    p.add_argument("--prefill-tp", type=int, default=2)
    p.add_argument("--decode-tp", type=int, default=2)
    p.add_argument("--prefill-pp", type=int, default=1)
    p.add_argument("--decode-pp", type=int, default=1)
    p.add_argument("--prefill-block-size", type=int, default=0)
    p.add_argument("--decode-block-size", type=int, default=0)
    p.add_argument("--prefill-layout", default="")
    p.add_argument("--decode-layout", default="")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill-address", default="", help="use this running prefill daemon (engine id 'prefill') instead of starting one")
    p.add_argument("--decode-address", default="", help="use this running decode daemon (engine id 'decode') instead of starting one")
    p.add_argument("--transport", choices=["tcp", "samehost", "nixl"], default="tcp",
                   help="tcp: the cross-host data plane over loopback; samehost: direct copies between mapped regions; "
                        "nixl: NIXL/UCX moves the bytes (pip install 'kvd[nixl]')")
