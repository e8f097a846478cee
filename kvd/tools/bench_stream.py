"""``kvd bench --sections stream``: what the transfer adds to time-to-first-
token, pulled after prefill against streamed layer by layer.

Two real daemons and one rank process on each side (``demo_worker``).
Prefill "computes" each layer for ``us_per_token`` microseconds a token (3
is an 8B model's prefill on one H100, about 100 ms a layer at 32k tokens)
and writes that layer's KV. In pull mode it publishes once every layer is
written and decode pulls then; streamed, it publishes first, decode's pull
starts at once, and each layer crosses once prefill says it is saved. The
figure is the same in both: from prefill's last layer to decode holding
every byte, which is what the transfer adds to TTFT. Every byte is checked.
"""

from __future__ import annotations

import multiprocessing as mp
import secrets
from collections.abc import Callable
from typing import Any

from kvd.core.spec import WorkerId
from kvd.tools.demo import Daemons, call_workers, prefill_and_pull, stop_workers
from kvd.tools.demo_worker import EngineConfig, ModelConfig, worker_main

TOKENS = (256, 1024, 4096, 16384, 32768)
BLOCK = 16


def bench_stream(*, layers: int, heads: int, head_size: int, us_per_token: float, repeat: int, tokens: tuple[int, ...] = TOKENS,
                 say: Callable[[str], None]) -> dict[str, Any]:
    model = ModelConfig(layers, heads, head_size, "bfloat16", False)
    blocks = max(tokens) // BLOCK + 2
    per_token = layers * heads * head_size * 2 * 2
    say(f"stream: one request, {layers} layers x {heads} KV heads x {head_size} bf16 ({per_token >> 10} KiB a token), TP1 -> TP1 over TCP; "
        f"prefill computes {us_per_token:g} us a token a layer")
    say("  after prefill = from prefill's last layer to decode holding every byte (what the transfer adds to TTFT), best of "
        f"{repeat}")
    say(f"  {'tokens':>7} {'MB':>8} {'prefill ms':>11} {'pull ms':>9} {'streamed ms':>12} {'streamed/pull':>14}")
    daemons = Daemons()
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    rows = []
    try:
        sides: dict[str, Any] = {}
        for eid in ("prefill", "decode"):
            info = daemons.start(eid, ["--same-host", "off", "--metrics-port", "-1"])
            parent, child = ctx.Pipe()
            engine = EngineConfig(eid, 1, 1, BLOCK, "NHD", blocks)
            proc = ctx.Process(target=worker_main, args=(info["grpc"], WorkerId(eid, 0, 1, 0, 1), engine, model, child), daemon=True)
            proc.start()
            procs.append(proc)
            conns.append(parent)
            if not parent.poll(120) or parent.recv()[0] != "ready":
                raise SystemExit(f"the bench's {eid} rank did not start")
            sides[eid] = [parent]
        ids = list(range(1, blocks))
        n = 0
        for ntok in tokens:
            nblocks = -(-ntok // BLOCK)
            layer_s = us_per_token * ntok / 1e6
            best = {}
            for stream in (False, True):
                times = []
                for _ in range(repeat):
                    n += 1
                    rid, seed = f"s{n}", n
                    req = (rid, seed, ids[:nblocks], ntok, secrets.token_bytes(32))
                    results, computed = prefill_and_pull(sides, [req], [ids[:nblocks]], layer_s, stream)
                    _elapsed, _nbytes, failed, _invalid, landed = results[0]
                    if failed:
                        raise SystemExit(f"stream bench: {rid} failed: {failed}")
                    bad = call_workers(sides["decode"], "verify", [[(rid, seed, ids[:nblocks], ntok)]])[0]
                    if bad:
                        raise SystemExit(f"stream bench: {rid} landed wrong bytes: {bad}")
                    times.append(landed - computed)
                best[stream] = min(times)
            row = {"tokens": ntok, "bytes": ntok * per_token, "prefill_ms": 1e3 * layer_s * layers, "pull_ms": 1e3 * best[False],
                   "stream_ms": 1e3 * best[True], "ratio": best[True] / best[False]}
            rows.append(row)
            say(f"  {ntok:>7} {row['bytes'] / 1e6:8.1f} {row['prefill_ms']:11.0f} {row['pull_ms']:9.1f} {row['stream_ms']:12.1f} {row['ratio']:14.2f}")
    finally:
        stop_workers(conns, procs)
        daemons.stop()
    return {"stream": rows, "stream_vs_pull_long": rows[-1]["ratio"], "stream_vs_pull_short": rows[0]["ratio"]}

