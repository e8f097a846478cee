"""The baselines kvd bench measures beside kvd: peer engines moving the same
request of scattered blocks, and a plain socket moving its bytes.

Mooncake Transfer Engine (when importable) moves the same shape with its
``tcp`` protocol and P2P handshake: one batch READ of every unit, by the
decode side from the prefill side's registered memory, in two processes.

NIXL (when installed) moves the same request shape kvd's transport bench
moves: ``blocks x layers`` units of ``unit`` bytes at shuffled offsets on both
sides, one descriptor per unit, as vLLM's NixlConnector posts them, READ by
the decode side from the prefill side's registered memory. Two separate
processes, so UCX cannot cheat through shared address space. ``ucx_tls``
pins UCX's transports (``tcp`` to compare with kvd's TCP path); empty lets
UCX pick (shared memory / CMA on one host, to compare with kvd's same-host
path).

The plain socket baselines are in ``bench_socket``.
"""

from __future__ import annotations

import contextlib
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


def _agent(name: str, ucx_tls: str, threads: int = 0) -> Any:
    if ucx_tls:
        os.environ["UCX_TLS"] = ucx_tls  # read once, when UCX starts in this process
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from kvd.transport.nixl import _api

    api = _api()
    return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"], num_threads=threads))


def _target(conn: Any, nbytes: int, ucx_tls: str, threads: int) -> None:
    import torch

    agent = _agent("bench-target", ucx_tls, threads)
    buf = torch.ones(nbytes, dtype=torch.uint8)
    reg = agent.register_memory([(buf.data_ptr(), nbytes, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), buf.data_ptr()))
    conn.recv()  # the initiator is done
    agent.deregister_memory(reg)


def _initiator(conn: Any, nbytes: int, ucx_tls: str, threads: int, ctl: Any) -> None:
    """Serves ``("try", unit)`` on ``ctl`` (seconds of one READ of the whole
    request in scattered ``unit``-byte blocks), ``("check", unit)`` (every
    byte arrived) and ``("stop",)``. As vLLM's NixlConnector does, each unit
    size's descriptor lists (every block, both sides) are prepared once,
    and a request picks its blocks by index (``make_prepped_xfer``)."""
    import numpy as np
    import torch

    agent = _agent("bench-initiator", ucx_tls, threads)
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    reg = agent.register_memory([(buf.data_ptr(), nbytes, 0, "")], "DRAM")
    metadata, base = conn.recv()
    remote = agent.add_remote_agent(metadata)
    remote = remote.decode() if isinstance(remote, bytes) else remote
    prepped: dict[int, tuple[Any, Any]] = {}
    tries = 0
    while True:
        cmd = ctl.recv()
        if cmd[0] == "stop":
            break
        unit = cmd[1]
        n = nbytes // unit
        if cmd[0] == "check":
            ctl.send(bool(buf.eq(1).all()))
            buf.zero_()
            continue
        if unit not in prepped:
            blocks = np.arange(n, dtype=np.uint64) * np.uint64(unit)
            local = np.stack([np.uint64(buf.data_ptr()) + blocks, np.full(n, unit, dtype=np.uint64), np.zeros(n, dtype=np.uint64)], axis=1)
            far = np.stack([np.uint64(base) + blocks, np.full(n, unit, dtype=np.uint64), np.zeros(n, dtype=np.uint64)], axis=1)
            prepped[unit] = (agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM"), agent.prep_xfer_dlist(remote, far, "DRAM"))
        local_h, far_h = prepped[unit]
        rng = np.random.default_rng(tries)
        tries += 1
        mine, theirs = rng.permutation(n).astype(np.int32), rng.permutation(n).astype(np.int32)  # chosen before the clock starts
        t0 = time.perf_counter()
        h = agent.make_prepped_xfer("READ", local_h, mine, far_h, theirs)
        state = agent.transfer(h)
        while state == "PROC":
            state = agent.check_xfer_state(h)
        seconds = time.perf_counter() - t0
        agent.release_xfer_handle(h)
        ctl.send(seconds if state == "DONE" else f"NIXL READ ended {state}")
    for local_h, far_h in prepped.values():
        agent.release_dlist_handle(local_h)
        agent.release_dlist_handle(far_h)
    agent.remove_remote_agent(remote)
    agent.deregister_memory(reg)
    conn.send("done")


class NixlPair:
    """Two NIXL agents in their own processes, up for a whole round, so
    that their tries alternate with kvd's (starting them costs seconds). The
    reader prepares its descriptor lists once per unit size, as vLLM's
    NixlConnector does, and gets as many UCX threads as kvd stripes a read
    over (``threads``)."""

    prepped = True

    def __init__(self, nbytes: int, ucx_tls: str = "", threads: int = 2) -> None:
        ctx = mp.get_context("spawn")
        a, b = ctx.Pipe()
        self._ctl, ctl = ctx.Pipe()
        self.nbytes = nbytes
        self._target = ctx.Process(target=_target, args=(a, nbytes, ucx_tls, threads), daemon=True)
        self._initiator = ctx.Process(target=_initiator, args=(b, nbytes, ucx_tls, threads, ctl), daemon=True)
        self._target.start()
        self._initiator.start()
        self._warm: set[int] = set()

    def _ask(self, *cmd: Any) -> Any:
        self._ctl.send(cmd)
        if not self._ctl.poll(120):
            raise RuntimeError(f"NIXL initiator did not answer {cmd[0]} (exit code {self._initiator.exitcode})")
        got = self._ctl.recv()
        if isinstance(got, str):
            raise RuntimeError(got)
        return got

    def one_try(self, unit: int) -> float:
        """GB/s of one READ of the request in scattered ``unit``-byte blocks
        (the first at each size, which prepares and connects, is not timed)."""
        if unit not in self._warm:
            self._ask("try", unit)
            self._warm.add(unit)
        return float(self.nbytes / self._ask("try", unit) / 1e9)

    def check(self, unit: int) -> None:
        if not self._ask("check", unit):
            raise RuntimeError("NIXL READ moved wrong bytes")

    def close(self) -> None:
        try:
            if self._initiator.is_alive():
                self._ctl.send(("stop",))
        finally:
            _reap(self._initiator, self._target)


# ------------------------------------------------------------------ Mooncake

def mooncake_installed() -> str:
    """Empty when Mooncake Transfer Engine can be loaded here, else why not."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("mooncake") is None:
        return "Mooncake Transfer Engine is not installed (pip install 'kvd[mooncake]')"
    # Import it in a child: a missing system library must not take the bench down.
    r = subprocess.run([sys.executable, "-c", "import mooncake.engine"], capture_output=True, text=True, timeout=60)
    if r.returncode:
        last = (r.stderr.strip().splitlines() or ["import failed"])[-1]
        return f"Mooncake Transfer Engine does not load: {last} (it needs libibverbs1 even for TCP)"
    return ""


MOONCAKE_BATCH = 1024


def _mooncake_log(pid: int) -> str:
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"kvd-bench-mooncake-{pid}.log")


def _mooncake_engine() -> Any:
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    # glog prints a harmless error line per engine at start; keep the bench's
    # table readable: this child's stderr goes to a file, shown if it fails.
    log = os.open(_mooncake_log(os.getpid()), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 2)
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("Mooncake TransferEngine.initialize failed")
    return engine


def _mooncake_target(conn: Any, nbytes: int) -> None:
    import torch

    engine = _mooncake_engine()
    buf = torch.ones(nbytes, dtype=torch.uint8)
    if engine.register_memory(buf.data_ptr(), nbytes) != 0:
        raise RuntimeError("Mooncake register_memory failed")
    conn.send((f"127.0.0.1:{engine.get_rpc_port()}", buf.data_ptr()))
    conn.recv()  # the initiator is done


def _mooncake_initiator(conn: Any, nbytes: int, unit: int, repeat: int, out: Any) -> None:
    import torch

    engine = _mooncake_engine()
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    if engine.register_memory(buf.data_ptr(), nbytes) != 0:
        raise RuntimeError("Mooncake register_memory failed")
    session, base = conn.recv()
    n = nbytes // unit
    best = float("inf")
    for r in range(repeat + 1):  # the first one connects
        local = (buf.data_ptr() + _offsets(n, unit, 2 * r)).tolist()
        far = (base + _offsets(n, unit, 2 * r + 1)).tolist()
        t0 = time.perf_counter()
        for i in range(0, n, MOONCAKE_BATCH):  # its batches are bounded; 1024 is what it takes here
            j = min(n, i + MOONCAKE_BATCH)
            if engine.batch_transfer_sync_read(session, local[i:j], far[i:j], [unit] * (j - i)) != 0:
                raise RuntimeError("Mooncake batch_transfer_sync_read failed")
        if r:
            best = min(best, time.perf_counter() - t0)
    ok = bool(buf.eq(1).all())
    conn.send("done")
    out.put((nbytes / best / 1e9, ok))


def mooncake_read_gbps(nbytes: int, unit: int, repeat: int) -> float:
    """Best GB/s of Mooncake TE (tcp) batch READs of one scattered request."""
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    out = ctx.Queue()
    target = ctx.Process(target=_mooncake_target, args=(a, nbytes), daemon=True)
    initiator = ctx.Process(target=_mooncake_initiator, args=(b, nbytes, unit, repeat, out), daemon=True)
    target.start()
    initiator.start()
    try:
        gbps, ok = _result(out, initiator, "Mooncake")
    except RuntimeError as e:
        with contextlib.suppress(OSError), open(_mooncake_log(initiator.pid or 0)) as f:
            raise RuntimeError(f"{e}; its log ends: {' | '.join(f.read().splitlines()[-5:])}") from None
        raise
    finally:
        _reap(initiator, target)
        for p in (initiator, target):
            with contextlib.suppress(OSError):
                os.unlink(_mooncake_log(p.pid or 0))
    if not ok:
        raise RuntimeError("Mooncake READ moved wrong bytes")
    return float(gbps)


def _result(out: Any, initiator: Any, peer: str) -> Any:
    """The initiator's result, or an error as soon as it died without one."""
    import queue

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            return out.get(timeout=0.5)
        except queue.Empty:
            if not initiator.is_alive():
                try:
                    return out.get(timeout=1)
                except queue.Empty:
                    raise RuntimeError(f"the {peer} initiator exited with {initiator.exitcode} before reporting") from None
    raise RuntimeError(f"the {peer} initiator reported nothing in 300 s")


def _reap(*procs: Any) -> None:
    for p in procs:
        p.join(timeout=30)
    for p in procs:
        if p.is_alive():
            p.kill()


# ---------------------------------------------------------------- plain sockets
