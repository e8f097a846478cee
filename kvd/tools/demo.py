"""``kvd demo``: a real P/D transfer on loopback, every byte verified.

Starts a prefill daemon and a decode daemon (``kvd serve`` processes), one
worker process per rank on each side with KV caches in shared memory, then
moves a few hundred requests of varying lengths and checks every valid token
of every block on the decode side against the logical pattern.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from kvd.core.qos import parse_shares
from kvd.core.spec import WorkerId
from kvd.testing.daemons import DaemonDidNotStart, DaemonProc, start_daemon
from kvd.testing.metrics import scrape
from kvd.tools.arguments import COUNT, POSITIVE, seconds
from kvd.tools.demo_worker import EngineConfig, ModelConfig, Prefill, worker_main

# ---------------------------------------------------------------- driver


class Daemons:
    """``kvd serve`` subprocesses (``kvd.testing.daemons``) in a folder of their own."""

    def __init__(self) -> None:
        self.started: list[DaemonProc] = []
        self.tmp = tempfile.mkdtemp(prefix="kvd-demo-")

    @property
    def procs(self) -> list[subprocess.Popen[bytes]]:
        return [d.proc for d in self.started]

    def start(self, engine_id: str, extra: Sequence[str] = ()) -> dict[str, Any]:
        """Start ``kvd serve``; ``extra`` are more flags. Returns its ready file."""
        return self.ready(self.launch(engine_id, extra))

    def launch(self, engine_id: str, extra: Sequence[str] = ()) -> DaemonProc:
        """Start ``kvd serve`` without waiting for it (``ready`` does): daemons
        launched together boot in parallel."""
        d = start_daemon(engine_id, Path(self.tmp), *extra, with_parent=True)  # a killed demo or bench leaves none behind
        self.started.append(d)
        return d

    @staticmethod
    def ready(d: DaemonProc) -> dict[str, Any]:
        """A launched daemon's ready file, waited for; one that did not start ends the run with its log."""
        try:
            return dict(d.info)
        except DaemonDidNotStart as e:
            raise SystemExit(str(e)) from None

    def stop(self) -> list[int]:
        """Stop the daemons; their folder (ready files, logs) goes too unless
        one exited with an error, when its log is the evidence."""
        for d in self.started:
            d.proc.terminate()
        codes = [d.proc.wait(timeout=30) for d in self.started]
        if not any(codes):
            shutil.rmtree(self.tmp, ignore_errors=True)
        return codes


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


def call_workers(conns: Sequence[Connection], cmd: str, args: Sequence[Any]) -> list[Any]:
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
    if args.min_tokens > args.max_tokens:
        raise SystemExit(f"kvd demo: --min-tokens={args.min_tokens} must be at most --max-tokens={args.max_tokens}")
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
        same_host += ["--verify", args.verify]
        tenants = [t for t in parse_shares(args.tenants) if t] if args.tenants else []
        if tenants:
            same_host += ["--tenants", args.tenants]
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
        after_prefill_s: list[float] = []  # per batch: from prefill's last layer to decode holding it all
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
            reqs = [(rid, seed, p, n, cap) for rid, seed, n, p, _d, cap in batch]
            if args.stream or args.layer_ms:
                results, _started, computed = prefill_and_pull(sides, reqs, [b[4] for b in batch], args.layer_ms / 1000, Prefill(stream=args.stream))
                after_prefill_s.append(max(r[4] for r in results) - computed)
            else:
                params = call_workers(sides["prefill"], "publish", [reqs] * len(sides["prefill"]))[0]
                # Requests take the tenants in turn (--tenants): each pull names its own.
                named = [(b[0], params[i], b[4], tenants[int(b[0].rsplit("-", 1)[1]) % len(tenants)] if tenants else "") for i, b in enumerate(batch)]
                results = call_workers(sides["decode"], "pull", [named] * len(sides["decode"]))
            transfer_s += max(r[0] for r in results)
            total_bytes += sum(r[1] for r in results)
            for r in results:
                failures.update(r[2])
            total_blocks += sum(len(b[4]) for b in batch)
            if first_mismatch is None:
                verdicts = call_workers(sides["decode"], "verify", [[(rid, seed, d, n) for rid, seed, n, _p, d, _c in batch if rid not in failures]] * len(sides["decode"]))
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
            for box, (s, _r) in zip(sent, call_workers(sides["prefill"], "finished", [None] * len(sides["prefill"])), strict=True):
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
        say(f"  throughput     {gbps:.2f} GB/s (bytes / time from pull to finished_recving"
            + (", prefill's compute included: the pull starts with it)" if args.stream else ")"))
        say(f"  wall time      {wall:.1f} s (including filling and verifying)")
        if after_prefill_s:
            say(f"  after prefill  {1e3 * sum(after_prefill_s) / len(after_prefill_s):.1f} ms a batch on average, worst {1e3 * max(after_prefill_s):.1f} ms "
                f"(from prefill's last layer, {args.layer_ms:g} ms each, to decode holding every byte: what the transfer adds to TTFT; "
                f"{'streamed layer by layer' if args.stream else 'pulled after prefill'})")
        say(f"  failures       {len(failures)}" + (f" (first: {next(iter(failures.values()))})" if failures else ""))
        say(f"  finished_sending reported by all {len(sent)} prefill ranks for {len(sent_everywhere)} of {args.requests} requests")
        ok = first_mismatch is None and not failures and len(sent_everywhere) >= args.requests
        if args.verify != "off" and d_info.get("metrics"):
            checks = {r: scrape(f"http://{d_info['metrics']}/metrics", "kvd_verify_checks_total", result=r) for r in ("ok", "mismatch", "unverified")}
            say(f"  --verify {args.verify:<8} decode's daemon checked {checks['ok']:.0f} reads clean against prefill's digests, "
                f"{checks['mismatch']:.0f} mismatched, {checks['unverified']:.0f} unverified")
            ok = ok and checks["mismatch"] == 0 and checks["ok"] > 0
        if tenants and p_info.get("metrics"):
            sent_by = {t: scrape(f"http://{p_info['metrics']}/metrics", "kvd_qos_bytes_total", priority="standard", tenant=t) for t in tenants}
            say(f"  --tenants      {args.tenants}: prefill's daemon sent " + ", ".join(f"{t} {b / 1e6:.1f} MB" for t, b in sent_by.items())
                + " (each its own requests' bytes; shares hold where the wire is contended: kvd bench --sections qos)")
            ok = ok and all(b > 0 for b in sent_by.values())
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
            say(f"  daemons exited with {codes}; their logs: {daemons.tmp}")
            ok = False
        return 0 if ok else 1
    finally:
        stop_workers(pipes, procs)
        for p in daemons.procs:
            if p.poll() is None:
                p.kill()


def stop_workers(pipes: Sequence[Connection], procs: Sequence[Any]) -> None:
    """Closing a worker's pipe ends it through its own finally, which unlinks
    its shm caches; a killed worker would leave them in /dev/shm."""
    for c in pipes:
        c.close()
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()


def prefill_and_pull(sides: dict[str, list[Connection]], reqs: Sequence[Any], decode_ids: Sequence[list[int]], layer_s: float,
                     how: Prefill) -> tuple[list[Any], float, float]:
    """Prefill computes ``reqs`` layer by layer while (streamed) or before
    (pull mode) decode pulls them; with nothing published, prefill computes
    alone and decode does nothing. Returns decode's results, when prefill
    started and when its last layer was done."""
    prefill, decode = sides["prefill"], sides["decode"]

    def answer(c: Connection) -> Any:
        status, value = c.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    for c in prefill:
        c.send(("prefill", (reqs, layer_s, how)))
    published = [answer(c) for c in prefill]  # every rank's (the same request params)
    params = published[0]
    if how.publish:
        for c in decode:
            c.send(("pull", [(r[0], params[i], ids, "") for i, (r, ids) in enumerate(zip(reqs, decode_ids, strict=True))]))
    times = [answer(c) for c in prefill]
    started, computed = min(t[0] for t in times), max(t[1] for t in times)
    return ([answer(c) for c in decode] if how.publish else []), started, computed


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
    p.add_argument("--requests", type=POSITIVE, default=300, help="requests moved prefill to decode")
    p.add_argument("--concurrency", type=POSITIVE, default=16, help="requests in flight per batch")
    p.add_argument("--min-tokens", type=POSITIVE, default=16, help="each request's prompt: at least this many tokens")
    p.add_argument("--max-tokens", type=POSITIVE, default=1024, help="and at most this many")
    p.add_argument("--layers", type=POSITIVE, default=8, help="model layers")
    p.add_argument("--kv-heads", type=POSITIVE, default=8, help="the model's KV heads (Mamba2: its heads)")
    p.add_argument("--head-size", type=POSITIVE, default=128, help="head size (MLA: the latent width)")
    p.add_argument("--dtype", default="bfloat16", help="the caches' dtype (torch's name)")
    p.add_argument("--mla", action="store_true", help="an MLA model: one latent a token, replicated over TP ranks")
    p.add_argument("--sliding-window", type=COUNT, default=0, help="a hybrid model: layers on a window of this many tokens (0: none)")
    p.add_argument("--full-every", type=POSITIVE, default=2, help="with --sliding-window: every Nth layer is full attention")
    p.add_argument("--mamba-every", type=COUNT, default=0, help="a Mamba2 hybrid: every Nth layer from layer 0 is a Mamba2 layer (1: pure Mamba2; 0: none)")
    p.add_argument("--conv-layouts", default="SD,SD", help="the Mamba2 conv state's layout on prefill,decode: SD or DS each")
    p.add_argument("--block-size", type=POSITIVE, default=16, help="tokens a block, both sides (see --prefill-block-size, --decode-block-size)")
    p.add_argument("--num-blocks", type=POSITIVE, default=2048, help="prefill blocks per rank")
    p.add_argument("--prefill-tp", type=POSITIVE, default=2, help="prefill's TP size: one worker a rank")
    p.add_argument("--decode-tp", type=POSITIVE, default=2, help="decode's TP size")
    p.add_argument("--prefill-pp", type=POSITIVE, default=1, help="prefill's PP size")
    p.add_argument("--decode-pp", type=POSITIVE, default=1, help="decode's PP size")
    p.add_argument("--prefill-block-size", type=COUNT, default=0, help="prefill's own block size (0: --block-size)")
    p.add_argument("--decode-block-size", type=COUNT, default=0, help="decode's own block size (0: --block-size)")
    p.add_argument("--prefill-layout", default="", help="prefill's cache layout: a name (NHD, HND, ...) or dims (kv,block,token,head,dim); default NHD")
    p.add_argument("--decode-layout", default="", help="decode's cache layout, as --prefill-layout")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompt lengths and the cache contents")
    p.add_argument("--prefill-address", default="", help="use this running prefill daemon (engine id 'prefill') instead of starting one")
    p.add_argument("--decode-address", default="", help="use this running decode daemon (engine id 'decode') instead of starting one")
    p.add_argument("--stream", action="store_true",
                   help="layer-wise streaming: prefill publishes first and each layer crosses once saved, while the next computes")
    p.add_argument("--layer-ms", type=seconds(positive=False), default=0.0,
                   help="simulate prefill compute: this many ms a layer (with --stream, or alone for pull mode after it)")
    p.add_argument("--tenants", default="", help="name=share,... : both daemons order the wire by these tenants' shares, "
                   "and requests take them in turn (docs/qos.md)")
    p.add_argument("--verify", choices=["off", "sampled", "full"], default="off",
                   help="the daemons' end-to-end verification: prefill digests what it publishes, decode checks what landed against it")
    p.add_argument("--transport", choices=["tcp", "samehost", "nixl"], default="tcp",
                   help="tcp: the cross-host data plane over loopback; samehost: direct copies between mapped regions; "
                        "nixl: NIXL/UCX moves the bytes (pip install 'kvd[nixl]')")
