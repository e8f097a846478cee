"""Peer engines measured the way kvd is: one request of scattered blocks.

NIXL (when installed) moves the same request shape kvd's transport bench
moves: ``blocks x layers`` units of ``unit`` bytes at shuffled offsets on both
sides, one descriptor per unit, as vLLM's NixlConnector posts them, READ by
the decode side from the prefill side's registered memory. Two separate
processes, so UCX cannot cheat through shared address space. ``ucx_tls``
pins UCX's transports (``tcp`` to compare with kvd's TCP path); empty lets
UCX pick (shared memory / CMA on one host, to compare with kvd's same-host
path).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any


def nixl_installed() -> bool:
    from kvd.transport.nixl import available

    return not available()


def _offsets(n: int, unit: int, seed: int) -> Any:
    import numpy as np

    return np.random.default_rng(seed).permutation(n).astype(np.uint64) * np.uint64(unit)


def _agent(name: str, ucx_tls: str) -> Any:
    if ucx_tls:
        os.environ["UCX_TLS"] = ucx_tls  # read once, when UCX starts in this process
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from kvd.transport.nixl import _api

    api = _api()
    return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))


def _target(conn: Any, nbytes: int, ucx_tls: str) -> None:
    import torch

    agent = _agent("bench-target", ucx_tls)
    buf = torch.ones(nbytes, dtype=torch.uint8)
    reg = agent.register_memory([(buf.data_ptr(), nbytes, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), buf.data_ptr()))
    conn.recv()  # the initiator is done
    agent.deregister_memory(reg)


def _initiator(conn: Any, nbytes: int, unit: int, repeat: int, ucx_tls: str, out: Any) -> None:
    import numpy as np
    import torch

    agent = _agent("bench-initiator", ucx_tls)
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    reg = agent.register_memory([(buf.data_ptr(), nbytes, 0, "")], "DRAM")
    metadata, base = conn.recv()
    remote = agent.add_remote_agent(metadata)
    remote = remote.decode() if isinstance(remote, bytes) else remote
    n = nbytes // unit
    best = float("inf")
    for r in range(repeat + 1):  # the first one connects
        local = np.zeros((n, 3), dtype=np.uint64)
        far = np.zeros((n, 3), dtype=np.uint64)
        local[:, 0] = np.uint64(buf.data_ptr()) + _offsets(n, unit, 2 * r)
        far[:, 0] = np.uint64(base) + _offsets(n, unit, 2 * r + 1)
        local[:, 1] = far[:, 1] = unit
        t0 = time.perf_counter()
        h = agent.initialize_xfer("READ", agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(far, "DRAM"), remote)
        state = agent.transfer(h)
        while state == "PROC":
            state = agent.check_xfer_state(h)
        seconds = time.perf_counter() - t0
        agent.release_xfer_handle(h)
        if state != "DONE":
            raise RuntimeError(f"NIXL READ ended {state}")
        if r:
            best = min(best, seconds)
    ok = bool(buf.eq(1).all())
    agent.remove_remote_agent(remote)
    agent.deregister_memory(reg)
    conn.send("done")
    out.put((nbytes / best / 1e9, ok))


def nixl_read_gbps(nbytes: int, unit: int, repeat: int, ucx_tls: str = "") -> float:
    """Best GB/s of NIXL READs of one scattered request between two processes."""
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    out = ctx.Queue()
    target = ctx.Process(target=_target, args=(a, nbytes, ucx_tls), daemon=True)
    initiator = ctx.Process(target=_initiator, args=(b, nbytes, unit, repeat, ucx_tls, out), daemon=True)
    target.start()
    initiator.start()
    try:
        gbps, ok = out.get(timeout=300)
    finally:
        initiator.join(timeout=30)
        target.join(timeout=30)
        for p in (initiator, target):
            if p.is_alive():
                p.kill()
    if not ok:
        raise RuntimeError("NIXL READ moved wrong bytes")
    return float(gbps)
