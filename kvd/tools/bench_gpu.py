"""``kvd bench --sections gpu``: GPU caches on both sides (where CUDA is available).

kvd's TCP path (pinned staging on CUDA streams) against a plain socket and
the PCIe copies it needs; the same-host path (CUDA IPC, device to device)
against a device memcpy, whole pulls and the piece kernel alone; and D's
pull phases, which say where a whole pull's time goes beyond the copy.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvd.daemon.config import DaemonConfig
from kvd.tools.bench_pair import BenchPair
from kvd.tools.bench_pair import best_seconds as _best
from kvd.tools.bench_socket import best_socket

UNIT_SIZES = {"16k": 16 << 10, "1m": 1 << 20}


def _device_copy_baselines(nbytes: int, repeat: int) -> dict[str, float]:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty_like(dev)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def timed(fn: Callable[[], object]) -> float:
        def run() -> None:
            fn()
            torch.cuda.synchronize()  # the copies are asynchronous

        return nbytes / _best(run, repeat) / 1e9

    return {
        "gpu_d2h_gbps": timed(lambda: host.copy_(dev, non_blocking=True)),
        "gpu_h2d_gbps": timed(lambda: dev.copy_(host, non_blocking=True)),
        "gpu_d2d_gbps": timed(lambda: dev2.copy_(dev)),
    }


def bench_gpu(args: argparse.Namespace, say: Callable[[str], None]) -> dict[str, Any]:
    """GPU caches on both sides: kvd's TCP path (pinned staging on CUDA
    streams) against a plain socket and the PCIe copies it needs, and the
    same-host path (CUDA IPC, device to device) against a device memcpy."""
    if not torch.cuda.is_available():
        say("gpu: not measured: no CUDA device")
        return {"gpu": None}
    nbytes, layers = args.transfer_mib << 20, 4
    out: dict[str, Any] = _device_copy_baselines(nbytes, args.repeat)
    torch.cuda.empty_cache()
    # kvd stripes a read over this many connections: the socket gets as many.
    out["gpu_socket_gbps"], out["gpu_socket_connections"] = best_socket(nbytes, args.repeat, DaemonConfig("bench").stripes_per_read)
    say(f"gpu: one request of {args.transfer_mib} MiB, scattered block ids, {layers} layers, GPU caches on both sides, best of {args.repeat}")
    for key, label in (("gpu_d2h_gbps", "pinned D2H copy"), ("gpu_h2d_gbps", "pinned H2D copy"), ("gpu_d2d_gbps", "device memcpy"),
                       ("gpu_socket_gbps", f"plain socket, {out['gpu_socket_connections']} conns")):
        say(f"  {label:<34} {out[key]:6.2f} GB/s")
    rng = random.Random(0)
    for label in ("16k", "1m"):
        kernel = _device_pieces_gbps(nbytes, UNIT_SIZES[label] // 2, args.repeat)
        if kernel is not None:
            out[f"gpu_pieces_{label}_gbps"], out[f"gpu_pieces_kernel_{label}_gbps"] = kernel
            say(f"  {f'piece copy alone, {label} units':<34} {kernel[0]:6.2f} GB/s  (its kernel alone {kernel[1]:.2f})")
    for mode in ("tcp", "samehost"):
        pair = BenchPair(mode)
        try:
            for label in ("16k", "1m"):
                pair.prepare(f"gpu-{mode}-{label}", UNIT_SIZES[label], nbytes, layers, rng, "cuda")  # and its warm-up request
                before = pair.timings()
                best = out[f"gpu_{mode}_{label}_gbps"] = max(pair.one_try()[0] for _ in range(args.repeat))
                phases = _phase_means(before, pair.timings())
                out[f"gpu_{mode}_{label}_phases_ms"] = phases
                say(f"  {f'kvd {mode}, GPU to GPU, {label} units':<34} {best:6.2f} GB/s  (D's pull, mean ms: "
                    + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()) + ")")
        finally:
            pair.close()
    # Staging is hidden when the wire, not PCIe, sets the pace.
    slower = min(out["gpu_socket_gbps"], out["gpu_d2h_gbps"], out["gpu_h2d_gbps"])
    out["gpu_tcp_vs_socket_1m"] = out["gpu_tcp_1m_gbps"] / slower
    out["gpu_tcp_vs_socket_16k"] = out["gpu_tcp_16k_gbps"] / slower
    out["gpu_samehost_vs_d2d_1m"] = out["gpu_samehost_1m_gbps"] / out["gpu_d2d_gbps"]
    say(f"    gpu_tcp_vs_socket_16k   {out['gpu_tcp_vs_socket_16k']:.2f}  (kvd GPU to GPU over TCP, 16 KiB units / the slower of socket and PCIe)")
    say(f"    gpu_tcp_vs_socket_1m    {out['gpu_tcp_vs_socket_1m']:.2f}  (the same, 1 MiB units)")
    say(f"    gpu_samehost_vs_d2d_1m  {out['gpu_samehost_vs_d2d_1m']:.2f}  (kvd same-host GPU to GPU, pull to landed / device memcpy)")
    if "gpu_pieces_1m_gbps" in out:
        out["gpu_pieces_vs_d2d"] = min(out["gpu_pieces_16k_gbps"], out["gpu_pieces_1m_gbps"]) / out["gpu_d2d_gbps"]
        say(f"    gpu_pieces_vs_d2d       {out['gpu_pieces_vs_d2d']:.2f}  (the same-host path's piece kernel alone, worst unit size / device memcpy)")
    return out


def _device_pieces_gbps(nbytes: int, piece: int, repeat: int) -> tuple[float, float] | None:
    """The same-host path's copy alone: ``nbytes`` in scattered ``piece``-byte
    pieces (one block's K or V of one layer) from one GPU buffer into random
    places of another. GB/s with the addresses prepared and uploaded each
    time, as a read does, and of the kernel alone (CUDA events)."""
    from kvd.transport import device_pieces

    device = torch.device("cuda")
    if not device_pieces.available(device):
        return None
    n = nbytes // piece
    src = torch.zeros(n * piece, dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    order = np.random.default_rng(0)
    d_addrs = dst.data_ptr() + order.permutation(n).astype(np.uint64) * np.uint64(piece)
    s_addrs = src.data_ptr() + order.permutation(n).astype(np.uint64) * np.uint64(piece)

    def run() -> None:
        device_pieces.copy_pairs(d_addrs, s_addrs, piece, device)
        torch.cuda.synchronize()

    run()  # compiles the kernel
    whole = n * piece / _best(run, repeat) / 1e9
    pairs = device_pieces.PiecePairs(d_addrs, s_addrs, piece, device)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(max(3, repeat)):
        start.record()
        pairs.launch()
        stop.record()
        stop.synchronize()
        best = min(best, start.elapsed_time(stop) / 1e3)
    return whole, n * piece / best / 1e9


def _phase_means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Mean ms of each of D's pull phases (and P's serving) between two ``BenchPair.timings``."""
    out = {}
    for name, (total, count) in after.items():
        t0, c0 = before.get(name, (0.0, 0.0))
        if count > c0:
            out[name] = (total - t0) / (count - c0) * 1e3
    return out


# Within a round each figure is the best of this many tries (kvd's and the
# peer engines' throughput each after one untimed warm-up request).
