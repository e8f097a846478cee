"""``kvd bench --sections stream``: what the transfer adds to time-to-first-
token, pulled after prefill against streamed layer by layer, beside a busy
prefill.

Two real daemons and one rank process on each side (``demo_worker``).
Prefill computes each layer for ``us_per_token`` microseconds a token (3 is
an 8B model's prefill on one H100, about 100 ms a layer at 32k tokens) on
every core, with torch's threads, as a real forward keeps them busy: the
transfer and both daemons share those cores with it. In pull mode prefill
publishes once every layer is written and decode pulls then; streamed, it
publishes first, decode's pull starts at once, and each layer crosses once
prefill says it is saved. The same prompt computed alone (nothing
published) is the baseline, measured in the same run, its tries in turn
with the transfers'. Streamed, the figure is the time from prefill's start
to decode holding every byte, less the compute-only prefill's time beside
it: what the transfer adds to TTFT, a prefill slowed by the transfer
included. Pulled, nothing runs beside the compute, so the figure is the
time from that try's own last layer to decode holding every byte; taking a
separate compute-only try's time away instead would add the compute's
jitter, which on a busy machine is larger than a short prompt's transfer
(a CI run measured -5 ms for a 17 MB pull that way). Each is the median
over at least five tries. Decode's outcomes are pushed (``FinishedFeed``),
so no poll is in the figure. Every byte is checked.
"""

from __future__ import annotations

import multiprocessing as mp
import secrets
import statistics
from collections.abc import Callable
from typing import Any

from kvd.core.spec import WorkerId
from kvd.tools.demo import Daemons, call_workers, prefill_and_pull, stop_workers
from kvd.tools.demo_worker import EngineConfig, ModelConfig, Prefill, worker_main

TOKENS = (256, 1024, 4096, 16384, 32768)
TRIES = 5  # at least, of each of compute-only, pulled and streamed
BLOCK = 16


def bench_stream(*, layers: int, heads: int, head_size: int, us_per_token: float, repeat: int, tokens: tuple[int, ...] = TOKENS,
                 say: Callable[[str], None]) -> dict[str, Any]:
    model = ModelConfig(layers, heads, head_size, "bfloat16", False)
    tries = max(repeat, TRIES)
    blocks = max(tokens) // BLOCK + 2
    per_token = layers * heads * head_size * 2 * 2
    say(f"stream: one request, {layers} layers x {heads} KV heads x {head_size} bf16 ({per_token >> 10} KiB a token), TP1 -> TP1 over TCP; "
        f"prefill computes {us_per_token:g} us a token a layer on every core")
    say(f"  what the transfer adds to TTFT, the median of {tries} tries: streamed, from prefill's start to decode holding every byte, "
        "less the same prefill computed alone beside it; pulled, from that prefill's last layer to decode holding every byte")
    say(f"  {'tokens':>7} {'MB':>8} {'prefill ms':>11} {'pull adds ms':>13} {'stream adds ms':>15} {'streamed/pull':>14}")
    daemons = Daemons()
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    rows = []
    try:
        sides: dict[str, Any] = {}
        launched = {eid: daemons.launch(eid, ["--same-host", "off", "--metrics-port", "-1"]) for eid in ("prefill", "decode")}  # boot together
        for eid, daemon in launched.items():
            info = daemons.ready(daemon)
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
        # One untimed request first: the daemons' handshake and connections, decode's
        # finished stream and prefill's compute calibration are paid once, as in serving.
        warm = ("warm", 0, ids[:1], BLOCK, secrets.token_bytes(32))
        prefill_and_pull(sides, [warm], [ids[:1]], 0.0, Prefill(busy=True))
        n = 0
        for ntok in tokens:
            nblocks = -(-ntok // BLOCK)
            layer_s = us_per_token * ntok / 1e6
            took: dict[str, list[float]] = {"compute": [], "pull": [], "stream": []}
            for _ in range(tries):
                for mode in took:  # in turn: a slow spell of the machine falls on all three
                    n += 1
                    rid, seed = f"s{n}", n
                    req = (rid, seed, ids[:nblocks], ntok, secrets.token_bytes(32))
                    how = Prefill(stream=mode == "stream", busy=True, publish=mode != "compute")
                    results, started, computed = prefill_and_pull(sides, [req], [ids[:nblocks]], layer_s, how)
                    if mode == "compute":
                        took[mode].append(computed - started)
                        continue
                    _elapsed, _nbytes, failed, _invalid, landed = results[0]
                    if failed:
                        raise SystemExit(f"stream bench: {rid} failed: {failed}")
                    bad = call_workers(sides["decode"], "verify", [[(rid, seed, ids[:nblocks], ntok)]])[0]
                    if bad:
                        raise SystemExit(f"stream bench: {rid} landed wrong bytes: {bad}")
                    # Pulled: after this try's own compute (nothing overlaps it). Streamed: from its start.
                    took[mode].append(landed - computed if mode == "pull" else landed - started)
            # Streamed: each try against the compute-only prefill beside it; the median of the tries.
            pull = statistics.median(took["pull"])
            stream = statistics.median(s - c for s, c in zip(took["stream"], took["compute"], strict=True))
            # A streamed transfer can hide wholly under the compute (within the noise: at most 0).
            row = {"tokens": ntok, "bytes": ntok * per_token, "prefill_ms": 1e3 * statistics.median(took["compute"]), "pull_ms": 1e3 * pull,
                   "stream_ms": 1e3 * stream, "ratio": max(stream, 0.0) / max(pull, 1e-3)}
            rows.append(row)
            say(f"  {ntok:>7} {row['bytes'] / 1e6:8.1f} {row['prefill_ms']:11.0f} {row['pull_ms']:13.1f} {row['stream_ms']:15.1f} {row['ratio']:14.2f}")
    finally:
        stop_workers(conns, procs)
        daemons.stop()
    return {"stream": rows, "stream_vs_pull_long": rows[-1]["ratio"], "stream_vs_pull_short": rows[0]["ratio"]}

