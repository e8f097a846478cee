"""``kvd bench --sections qos``: the wire's order under load (``--qos on``).

A P and a D daemon over TCP, D with tenants ``gold=3,silver=1,be=0.2``:

* **Small pulls under bulk.** Small pulls (``--qos-small-mib``, class
  interactive) one after another on an idle wire, then arriving at random
  (exponential gaps, mean 30 ms) while two bulk pulls (``--qos-bulk-mib``,
  class standard, back to back) keep the wire busy: the small pulls' p99
  loaded over unloaded. Beside it, the same small pulls in class standard:
  what the order buys.
* **Shares.** Tenants gold and silver each keep two pulls of half a bulk
  in flight (backlogged: never idle between pulls); the bytes P granted
  each over a window, gold / silver, against their shares' 3.
* **Best effort.** Meanwhile tenant ``be`` (share 0.2) pulls small
  requests one after another: each must finish.
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from kvd.core.spec import NAMED_LAYOUTS, KVCacheSpec
from kvd.tools.bench_pair import BenchPair, p99

LAYERS = 4
BLOCK_MIB = LAYERS  # 256 tokens x 8 heads x 128 x bf16 x K+V = 1 MiB a block a layer
TENANTS = "gold=3,silver=1,be=0.2"


class _Pulls:
    """Requests through a ``BenchPair`` with a place on the wire, several at once."""

    def __init__(self, pair: BenchPair) -> None:
        self.pair = pair
        self._n = 0
        self._lock = threading.Lock()

    def one(self, p_ids: list[int], d_ids: list[int], **qos: Any) -> float:
        """Publish, pull and wait: seconds from the pull to D's finished set."""
        with self._lock:
            self._n += 1
            rid = f"qos-{self._n}"
        return self.pair.transfer(rid, p_ids, d_ids, len(p_ids) * 256, timeout=300, **qos)


class _Loop(threading.Thread):
    """Pulls one after another until stopped; counts them."""

    def __init__(self, pulls: _Pulls, p_ids: list[int], d_ids: list[int], **qos: Any) -> None:
        super().__init__(daemon=True)
        self.pulls, self.p_ids, self.d_ids, self.qos = pulls, p_ids, d_ids, qos
        self.stop, self.done = threading.Event(), 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.pulls.one(self.p_ids, self.d_ids, **self.qos)
                self.done += 1
        except BaseException as e:  # reported by the bench, not lost in a thread
            self.error = e


def _granted(pair: BenchPair) -> dict[str, float]:
    """Bytes each tenant was granted the wire so far: by P, which orders its sends over TCP."""
    from kvd.testing.metrics import samples

    out: dict[str, float] = {}
    for s in samples(f"http://{pair.p['metrics']}/metrics"):
        if s.name == "kvd_qos_bytes_total":
            out[s.labels.get("tenant", "")] = out.get(s.labels.get("tenant", ""), 0.0) + s.value
    return out


def bench_qos(args: argparse.Namespace, say: Callable[[str], None]) -> dict[str, Any]:
    bulk = max(1, args.qos_bulk_mib // BLOCK_MIB)
    small = max(1, args.qos_small_mib // BLOCK_MIB)
    rng = random.Random(0)
    say(f"qos: both daemons with --qos on --tenants {TENANTS}; bulk pulls of {bulk * BLOCK_MIB} MiB, small of {small * BLOCK_MIB} MiB, TCP")
    pair = BenchPair("tcp", ("--qos", "on", "--tenants", TENANTS))
    try:
        # P: one bulk request's blocks, then a small one's; D: two bulk ranges, then small ones.
        pair.register(KVCacheSpec(256, 8, 128, "bfloat16", NAMED_LAYOUTS["NHD"], 2 * bulk + 4 * small + 1), LAYERS)
        pulls = _Pulls(pair)
        p_bulk, p_small = list(range(1, bulk + 1)), list(range(bulk + 1, bulk + small + 1))
        d_bulk = [list(range(1, bulk + 1)), list(range(bulk + 1, 2 * bulk + 1))]
        d_small = [list(range(2 * bulk + 1 + k * small, 2 * bulk + 1 + (k + 1) * small)) for k in range(4)]
        pulls.one(p_small, d_small[0], priority="interactive")  # the first pays for the handshake and connections
        count = args.qos_small_pulls
        idle = [pulls.one(p_small, d_small[i % 4], priority="interactive") for i in range(count)]
        loaded: dict[str, list[float]] = {"interactive": [], "standard": []}
        loops = [_Loop(pulls, p_bulk, d, priority="standard") for d in d_bulk]
        for loop in loops:
            loop.start()
        time.sleep(0.3)  # both bulk pulls on the wire
        for i in range(2 * count):
            time.sleep(rng.expovariate(1 / 0.03))
            cls = "interactive" if i % 2 == 0 else "standard"
            loaded[cls].append(pulls.one(p_small, d_small[i % 4], priority=cls))
        for loop in loops:
            loop.stop.set()
        for loop in loops:
            loop.join(timeout=300)
        out: dict[str, Any] = {"qos_small_p99_unloaded_ms": p99(idle) * 1e3, "qos_small_p99_loaded_ms": p99(loaded["interactive"]) * 1e3,
                               "qos_small_p99_loaded_standard_ms": p99(loaded["standard"]) * 1e3, "qos_bulk_pulls": sum(x.done for x in loops)}
        out["qos_small_p99_loaded_vs_unloaded"] = out["qos_small_p99_loaded_ms"] / out["qos_small_p99_unloaded_ms"]
        say(f"  small pull p99: unloaded {out['qos_small_p99_unloaded_ms']:.2f} ms, under bulk {out['qos_small_p99_loaded_ms']:.2f} ms "
            f"({out['qos_small_p99_loaded_vs_unloaded']:.2f}x); the same in class standard {out['qos_small_p99_loaded_standard_ms']:.2f} ms "
            f"({out['qos_bulk_pulls']} bulk pulls moved meanwhile)")
        # Shares: gold and silver backlogged (two pulls of half a bulk each in
        # flight, so a tenant is never idle between its pulls), be's small pulls beside them.
        half = max(1, bulk // 2)
        quarters = [d[:half] for d in d_bulk] + [d[half:2 * half] for d in d_bulk]
        tenants = [_Loop(pulls, p_bulk[:half], quarters[i], tenant=t) for i, t in enumerate(("gold", "silver", "gold", "silver"))]
        tenants.append(_Loop(pulls, p_small, d_small[0], tenant="be"))
        for loop in tenants:
            loop.start()
        time.sleep(0.5)
        before = _granted(pair)
        time.sleep(args.qos_share_seconds)
        after = _granted(pair)
        for loop in tenants:
            loop.stop.set()
        for loop in tenants:
            loop.join(timeout=300)
        for x in (*loops, *tenants):
            if x.error is not None:
                raise x.error
        moved = {t: after.get(t, 0.0) - before.get(t, 0.0) for t in ("gold", "silver", "be")}
        out["qos_tenant_ratio"] = moved["gold"] / max(moved["silver"], 1.0)
        out["qos_tenant_share_error"] = abs(out["qos_tenant_ratio"] / 3 - 1)
        out["qos_best_effort_pulls"] = tenants[-1].done
        out["qos_best_effort_finished"] = 1.0 if tenants[-1].done > 0 and not tenants[-1].is_alive() else 0.0
        say(f"  shares over {args.qos_share_seconds:g} s: gold {moved['gold'] / 1e9:.2f} GB, silver {moved['silver'] / 1e9:.2f} GB "
            f"(gold / silver {out['qos_tenant_ratio']:.2f}, shares 3); be (share 0.2) {moved['be'] / 1e9:.2f} GB in "
            f"{tenants[-1].done} pulls, every one finished")
        return out
    finally:
        pair.close()
