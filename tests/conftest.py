"""Fixtures that start real daemons as processes and act as real workers."""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvd.caches import allocate_kv_caches, local_group_tensors, release_all
from kvd.client import KvdClient
from kvd.core.topology import heads_of_rank
from kvd.proto import kvd_pb2 as pb
from kvd.spec import KVCacheSpec, ModelInfo, WorkerId, parse_layout
from kvd.testing import pattern
from kvd.testing.daemons import DaemonProc, start_daemon
from kvd.testing.metrics import scrape

__all__ = ["REPO", "DaemonProc", "Daemons", "TestWorker", "free_port", "local_group_tensors_plain", "make_worker", "scheduler_params", "scrape", "shm_mapped", "transfer", "wait_for"]

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Daemons:
    """The daemons a test starts (``kvd.testing.daemons``), in its folder, killed at its end."""

    tmp: Path
    started: list[DaemonProc] = field(default_factory=list)

    def start(self, engine_id: str, *extra: str, grpc_port: int = 0, same_host: str = "off", prefix: Sequence[str] = (),
              source: Path = REPO) -> DaemonProc:
        """A ``kvd serve`` process, started and not waited for (``.info`` waits).
        Tests use TCP unless they ask for the same-host path. ``prefix`` runs
        it elsewhere, e.g. inside a network namespace; ``source`` is the kvd
        tree it runs (another release's checkout)."""
        d = start_daemon(engine_id, self.tmp, "--same-host", same_host, *extra, name=f"{engine_id}-{len(self.started)}", grpc_port=grpc_port,
                         prefix=prefix, source=None if source == REPO else source)
        self.started.append(d)
        return d

    def kill_all(self) -> None:
        for d in self.started:
            d.kill()


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[Daemons]:
    ds = Daemons(tmp_path)
    yield ds
    ds.kill_all()


@dataclass
class TestWorker:
    """A worker in the test process: shm caches, a client, and pattern checks."""

    __test__ = False  # a helper, not a test class

    worker: WorkerId
    spec: KVCacheSpec
    caches: dict
    client: KvdClient
    model: ModelInfo

    @property
    def tensors(self):
        return local_group_tensors(self.spec, self.caches)

    @property
    def coords(self) -> pattern.RankCoords:
        return pattern.RankCoords.of(self.worker.tp_rank, self.worker.tp_size, self.model.total_num_kv_heads, self.spec.use_mla)

    def register(self):
        return self.client.register(self.caches, self.model, self.spec)

    def fill(self, seed, ids):
        pattern.fill(self.tensors, seed, ids, self.coords)

    def mismatch(self, seed, ids, num_tokens):
        return pattern.mismatch(self.tensors, seed, ids, self.coords, num_tokens)


def make_worker(address: str, engine_id: str, *, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, layers=4, heads=4, head_size=16,
                block_size=16, num_blocks=64, dtype="bfloat16", layout="NHD", register=True, local_heads=0, auth=None) -> TestWorker:
    model = ModelInfo(layers, heads)
    h = local_heads or heads_of_rank(tp_rank, tp_size, heads, False).count
    spec = KVCacheSpec(block_size, h, head_size, dtype, parse_layout(layout), num_blocks)
    per = -(-layers // pp_size)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(pp_rank * per, min(layers, (pp_rank + 1) * per))]
    caches = allocate_kv_caches(spec, names)
    w = TestWorker(WorkerId(engine_id, tp_rank, tp_size, pp_rank, pp_size), spec, caches, KvdClient(address, WorkerId(engine_id, tp_rank, tp_size, pp_rank, pp_size), auth=auth), model)
    w.client.wait_ready()
    if register:
        w.register()
    return w


def transfer(p_workers, d_workers, rid, seed, p_ids, d_ids, ntok, timeout=30):
    """One request published by every P worker and pulled by every D worker; D's finished sets."""
    cap = secrets.token_bytes(32)
    params = None
    for w in p_workers:
        w.fill(seed, p_ids)
        params = w.client.publish(rid, [p_ids], ntok, capability=cap)
    for w in d_workers:
        w.client.pull(rid, params, [d_ids])
    return params, [w.client.wait_finished(recving={rid}, timeout=timeout) for w in d_workers]


def scheduler_params(p_addr: str, engine_id: str, rid: str, cap: bytes, ids: list[int], ntok: int) -> pb.TransferParams:
    """Params as vLLM's scheduler makes them: before any worker published, so
    without generation or epoch (the connector's request_finished)."""
    return pb.TransferParams(remote_engine_id=engine_id, remote_address=p_addr, request_id=rid, capability=cap,
                             block_ids=[pb.BlockIds(ids=ids)], num_tokens=ntok, remote_tp_size=2, remote_pp_size=1)


def local_group_tensors_plain(spec, caches):
    """Canonical views of caches wherever they live (for the test's own fills)."""
    import torch

    from kvd.core.relayout import GroupTensors
    from kvd.core.spec import GroupSpec, LayerSpec, TensorRef

    base = next(iter(caches.values())).untyped_storage()
    region = torch.empty(0, dtype=torch.uint8, device=base.device).set_(base)
    layers = []
    for i, (name, t) in enumerate(caches.items()):
        off = t.data_ptr() - region.data_ptr()
        layers.append(LayerSpec(name, i, (TensorRef("r", off, tuple(t.shape), tuple(t.stride()), spec.layout),)))
    return GroupTensors.build(GroupSpec(0, spec, tuple(layers)), {"r": region})


@pytest.fixture(autouse=True)
def _release_shm() -> Iterator[None]:
    yield
    release_all()


def pytest_configure(config):
    os.environ.setdefault("PYTHONUNBUFFERED", "1")


@pytest.fixture(scope="session", autouse=True)
def _engine_tmp(tmp_path_factory: pytest.TempPathFactory) -> None:
    """vLLM engines bind ZMQ IPC sockets under VLLM_RPC_BASE_PATH and torch's
    rendezvous files under TMPDIR (both the system temp folder by default),
    and a killed engine leaves them there: the session's own folder takes
    them instead (``tests/test_vllm.py``'s engine environment uses it)."""
    os.environ.setdefault("VLLM_RPC_BASE_PATH", str(tmp_path_factory.mktemp("engine-tmp")))


# Shared memory a killed vLLM engine leaves behind: its executor's message
# ring (Python's ``psm_*``, 160 MiB) and a TP engine's CPU communicator
# (``vllm_dist_*``, 4 MiB a rank). A reused machine would fill /dev/shm.
ENGINE_SHM_PREFIXES = ("psm_", "vllm_dist_")


@pytest.fixture(scope="session", autouse=True)
def _engine_shm() -> Iterator[None]:
    """Unlinks, at the session's end, the engines' shared memory that
    appeared during it and that no live process has open or mapped."""
    shm = Path("/dev/shm")
    before = set(os.listdir(shm)) if shm.is_dir() else set()
    yield
    if not shm.is_dir():
        return
    left = {shm / n for n in set(os.listdir(shm)) - before if n.startswith(ENGINE_SHM_PREFIXES)}
    for path in left - _in_use(left):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _in_use(paths: set[Path]) -> set[Path]:
    """Which of ``paths`` some process has open or mapped."""
    names = {str(p) for p in paths}
    used: set[Path] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            maps = (proc / "maps").read_text()
            used.update(Path(n) for n in names if n in maps)
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if (target := os.readlink(fd)) in names:
                        used.add(Path(target))
    return used


_PORTS = random.SystemRandom()  # not the seeded module-level generator: runs must not pick the same ports


def free_port() -> int:
    """A port a server will bind later, from below the kernel's ephemeral range:
    a port the kernel hands out (``bind(0)``) may be taken by some connection's
    local end before the server binds it (NIXL's side channel once failed so)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    for _ in range(200):
        port = _PORTS.randrange(10000, max(10001, ephemeral_low))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def shm_mapped(pid: int) -> set[str]:
    """The /dev/shm files ``pid`` maps (unlinked ones too)."""
    out = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if "/dev/shm/" in line:
            out.add(line.split("/dev/shm/", 1)[1].removesuffix(" (deleted)"))
    return out


def wait_for(cond: Callable[[], bool], within: float, what: str) -> None:
    """Poll ``cond`` until it holds; fail with ``what`` after ``within`` seconds."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < within, what
        time.sleep(0.05)


# Fixtures made once a session: the previous release's worktree, the tiny
# model and its one-engine baselines. Imported last: those modules import from here.
from tests.release_support import previous  # noqa: E402, F401 - a fixture
from tests.vllm_support import baseline, baseline_f32, model_dir, other_vllm_python, vllm_python  # noqa: E402, F401 - fixtures

