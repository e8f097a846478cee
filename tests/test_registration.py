"""Registration paths a real engine uses: inferred specs, adopted tensors, CUDA IPC."""

from __future__ import annotations

import pytest
import torch

from kvd.caches import adopt_into_shm, allocate_kv_caches, local_group_tensors
from kvd.client import KvdClient
from kvd.core.spec import KVCacheSpec, ModelInfo, WorkerId, parse_layout
from kvd.testing import pattern
from kvd.transport.nixl import available as nixl_available
from tests.conftest import local_group_tensors_plain, make_worker, shm_mapped, transfer, wait_for


def test_spec_is_inferred_from_shape_and_strides(daemons):
    """vLLM shapes an HND cache as NHD and permutes strides; kvd sees HND."""
    p, d = daemons.start("prefill"), daemons.start("decode")
    pw = make_worker(p.grpc, "prefill", layout="NHD")
    hnd = KVCacheSpec(16, 4, 16, "bfloat16", parse_layout("HND"), 64)
    physical = allocate_kv_caches(hnd, [f"model.layers.{i}.self_attn.attn" for i in range(4)])
    # Present each layer in NHD shape order: (kv, block, token, head, dim).
    shaped = {name: t.permute(0, 1, 3, 2, 4) for name, t in physical.items()}
    client = KvdClient(d.grpc, WorkerId("decode"))
    client.register(shaped, ModelInfo(4, 4))
    import grpc

    from kvd.proto import kvd_pb2 as pb
    from kvd.proto import kvd_pb2_grpc as pbg

    with grpc.insecure_channel(d.grpc) as ch:
        st = pbg.AdminStub(ch).Status(pb.StatusRequest(), timeout=5)
    assert st.workers[0].layers == 4
    pw.fill(9, [1, 2, 3])
    params = pw.client.publish("r", [[1, 2, 3]], 40)
    client.pull("r", params, [[4, 5, 6]])
    f = client.wait_finished(recving={"r"}, timeout=30)
    assert f.details[("recving", "r")].outcome == "done"
    tensors = local_group_tensors(hnd, physical)
    assert pattern.mismatch(tensors, 9, [4, 5, 6], pattern.RankCoords(0), 40) is None


def test_adopt_moves_existing_tensors_into_shm_in_place(daemons):
    """vLLM's CPU backend: one buffer, every layer a view into it."""
    p, d = daemons.start("prefill"), daemons.start("decode")
    spec = KVCacheSpec(16, 4, 16, "bfloat16", parse_layout("NHD"), 32)
    buffer = torch.zeros(4, *spec.part_shape(), dtype=torch.bfloat16)
    caches = {f"model.layers.{i}.self_attn.attn": buffer[i] for i in range(4)}
    ids = [2, 3, 7]
    pattern.fill(local_group_tensors_plain(spec, caches), 5, ids, pattern.RankCoords(0))
    before = {k: v.clone() for k, v in caches.items()}
    objects = {k: id(v) for k, v in caches.items()}
    old_ptr = buffer.data_ptr()
    adopt_into_shm(caches)
    assert {k: id(v) for k, v in caches.items()} == objects  # the same tensor objects
    assert all(v.data_ptr() != old_ptr for v in caches.values())
    assert all(torch.equal(caches[k], before[k]) for k in caches)
    pc = KvdClient(p.grpc, WorkerId("prefill"))
    pc.register(caches, ModelInfo(4, 4), spec)
    # Writes through the engine's own tensor objects are what the daemon serves.
    pattern.fill(local_group_tensors_plain(spec, caches), 6, ids, pattern.RankCoords(0))
    dw = make_worker(d.grpc, "decode", num_blocks=32)
    params = pc.publish("r", [ids], 48)
    dw.client.pull("r", params, [[10, 11, 12]])
    f = dw.client.wait_finished(recving={"r"}, timeout=30)
    assert f.details[("recving", "r")].outcome == "done"
    assert dw.mismatch(6, [10, 11, 12], 48) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_caches_register_by_ipc_handle_and_transfer(daemons):
    p, d = daemons.start("prefill"), daemons.start("decode")
    spec = KVCacheSpec(16, 4, 16, "bfloat16", parse_layout("NHD"), 32)
    buffer = torch.zeros(4, *spec.part_shape(), dtype=torch.bfloat16, device="cuda")
    caches = {f"model.layers.{i}.self_attn.attn": buffer[i] for i in range(4)}
    ids = [1, 2]
    cpu = local_group_tensors_plain(spec, {k: v for k, v in caches.items()})
    pattern.fill(cpu, 3, ids, pattern.RankCoords(0))
    torch.cuda.synchronize()
    pc = KvdClient(p.grpc, WorkerId("prefill"))
    resp = pc.register(caches, ModelInfo(4, 4), spec)
    assert resp.registered_bytes >= buffer.numel() * 2
    dw = make_worker(d.grpc, "decode", num_blocks=32)
    params = pc.publish("r", [ids], 32)
    dw.client.pull("r", params, [[5, 6]])
    f = dw.client.wait_finished(recving={"r"}, timeout=60)
    assert f.details[("recving", "r")].outcome == "done", f.details
    assert dw.mismatch(3, [5, 6], 32) is None


def _calls_during(address: str, action) -> tuple[float, list[float]]:
    """Run ``action`` while another client calls the daemon back to back;
    returns how long it took and the latency of each call made inside it."""
    import threading
    import time

    import grpc

    from kvd.proto import kvd_pb2 as pb
    from kvd.proto import kvd_pb2_grpc as pbg

    calls: list[tuple[float, float]] = []
    stop = threading.Event()
    with grpc.insecure_channel(address) as ch:
        stub = pbg.AdminStub(ch)
        stub.Status(pb.StatusRequest(), timeout=30)

        def poll() -> None:
            while not stop.is_set():
                t = time.perf_counter()
                stub.Status(pb.StatusRequest(), timeout=30)
                calls.append((t, time.perf_counter() - t))

        poller = threading.Thread(target=poll)
        poller.start()
        time.sleep(0.1)
        t0 = time.perf_counter()
        try:
            action()
        finally:
            t1 = time.perf_counter()
            stop.set()
            poller.join()
    return t1 - t0, [d for t, d in calls if t0 <= t and t + d <= t1]


def test_the_daemon_answers_while_it_maps_a_big_cache(daemons):
    """Mapping a region faults in every page (seconds for a real cache). The
    daemon does it off its event loop, when a worker registers and when a
    same-host reader first maps the owner's regions, so it answers everyone
    else meanwhile. Done on the loop, no call made during either answered."""
    p, d = daemons.start("prefill", same_host="auto"), daemons.start("decode", same_host="auto")
    big = make_worker(p.grpc, "prefill", heads=8, head_size=128, num_blocks=4096, register=False)  # 1 GiB
    dw = make_worker(d.grpc, "decode", heads=8, head_size=128, num_blocks=64)
    took, inside = _calls_during(p.grpc, big.register)
    assert len(inside) >= 3 and max(inside) < took / 2, (took, inside)

    big.fill(3, [1, 2, 3])
    params = big.client.publish("r", [[1, 2, 3]], 48)

    def first_pull() -> None:  # the handshake maps P's gigabyte in D
        dw.client.pull("r", params, [[4, 5, 6]])
        f = dw.client.wait_finished(recving={"r"}, timeout=60)
        assert f.details[("recving", "r")].outcome == "done"

    took, inside = _calls_during(d.grpc, first_pull)
    assert len(inside) >= 3 and max(inside) < took / 2, (took, inside)
    assert dw.mismatch(3, [4, 5, 6], 48) is None
    assert "same-host path to engine=prefill: 1 ranks mapped" in d.log()


# In a process of its own: NIXL's native libraries clash with others a test session loads
# (grpc_tools' protoc: the import aborts the process), as kvd.transport.nixl.available says.
CANCELLED_WHILE_MAPPING = """
import asyncio, time
from kvd.caches import allocate_kv_caches, describe
from kvd.convert import registering_from_pb
from kvd.core.spec import KVCacheSpec, parse_layout
from kvd.daemon.metrics import Metrics
from kvd.daemon.registry import Registry
from kvd.proto import kvd_pb2 as pb
from kvd.transport.nixl import NixlAgent

spec = KVCacheSpec(16, 8, 128, "bfloat16", parse_layout("NHD"), 1024)  # 256 MiB over 4 layers
caches = allocate_kv_caches(spec, [f"model.layers.{i}.self_attn.attn" for i in range(4)])
described = describe([(spec, caches)])
req = registering_from_pb(pb.RegisterRequest(worker=pb.WorkerId(engine_id="prefill", tp_size=1, pp_size=1),
                                             model=pb.ModelInfo(num_layers=4, total_num_kv_heads=8),
                                             regions=described.regions, groups=described.groups))
agent = NixlAgent("kvd-test-cancelled-registration", 10_000)  # the daemon's default delay: its progress thread sleeps
registry = Registry("prefill", "epoch", "host", lambda: "", Metrics(), agent)

async def cancelled_while_mapping():
    task = asyncio.create_task(registry.register(req))
    await asyncio.sleep(0)  # it runs up to the mapping thread's await
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        print("cancelled")
    # The agent's version moves with every (de)registration: 1, mapped 2, undone 3.
    deadline = time.monotonic() + 30
    while agent.version < 3 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)

asyncio.run(cancelled_while_mapping())
print("version", agent.version, "registered", len(registry))
asyncio.run(registry.register(req))  # the same memory registers again, and stays
print("version", agent.version, "registered", len(registry))
registry.close()
"""


@pytest.mark.skipif(bool(nixl_available()), reason=f"NIXL NOT TESTED: {nixl_available()}")
def test_a_registration_cancelled_while_it_maps_leaves_nothing_registered():
    """A worker's Register maps its memory in a thread and registers it with
    NIXL (seconds for a real cache). Cancelled meanwhile (the client's deadline
    passed), the thread runs on: what it registered is undone when it ends,
    not left to nobody. (Before: NIXL kept the registration for good.)"""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    r = subprocess.run([sys.executable, "-c", CANCELLED_WHILE_MAPPING], capture_output=True, text=True, timeout=120, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    assert r.stdout.splitlines() == ["cancelled", "version 3 registered 0", "version 4 registered 1"], (r.stdout, r.stderr[-2000:])


@pytest.mark.parametrize("d_layout", ["NHD", "HND"], ids=["in-place", "relayout"])
def test_an_ended_workers_memory_is_unmapped_once_its_pull_is_done(daemons, d_layout):
    """A region's mapping lasts as long as a view of it (kvd/regions/shm.py: so a copy thread never
    writes to unmapped memory), so anything that keeps a finished pull keeps its worker's memory.
    A pull long enough for the lease heartbeat to renew it (256 MiB: a renewal every tick, 0.1 s)
    was kept by the heartbeat's loop variable until the next renewal; a relayout's (D in HND, P in
    NHD: its segments land through the copy threads) by each copy thread's last batch, which kept
    its jobs, until the thread's next batch. Here D's worker unregisters after that pull, and D's
    daemon must map its memory no more. Negative controls: the heartbeat's lists in its loop's frame
    (before 'beat'): the region was still mapped 10 s later (in-place); the copy threads keeping
    their last batch and its jobs: the same (relayout)."""
    p, d = daemons.start("prefill"), daemons.start("decode")
    shape = {"layers": 4, "heads": 8, "head_size": 128, "num_blocks": 520, "dtype": "float32"}  # 512 KiB a block
    pw, dw = make_worker(p.grpc, "prefill", **shape), make_worker(d.grpc, "decode", layout=d_layout, **shape)
    ids = list(range(1, 513))
    _, finished = transfer([pw], [dw], "long", 1, ids, ids, 512 * 16, timeout=120)
    assert finished[0].details[("recving", "long")].outcome == "done" and dw.mismatch(1, ids, 512 * 16) is None
    mine = shm_mapped(d.pid)
    assert len(mine) == 1, mine  # TCP: D maps its own worker's region only
    dw.client.unregister()
    wait_for(lambda: not shm_mapped(d.pid), 10, f"D still maps {mine} 10 s after its worker unregistered")


def test_an_alive_token_is_checked_by_name_and_one_out_of_sight_is_let_be(daemons):
    """``RegisterRequest.alive_shm`` must name a page kvd made, of the
    registering worker's user (the uid check regions have, test_security),
    that its process holds locked (``kvd.caches.alive_token``): one nobody
    holds would make a live worker look dead (and be removed with it). A token the
    daemon cannot open at all (it does not share the worker's /dev/shm)
    leaves the worker registered as before tokens, with a warning."""
    import os
    import uuid

    import grpc

    from kvd.caches import alive_token, describe
    from kvd.proto import kvd_pb2 as pb
    from kvd.proto import kvd_pb2_grpc as pbg
    from kvd.regions import shm

    p = daemons.start("prefill")
    spec = KVCacheSpec(16, 4, 16, "bfloat16", parse_layout("NHD"), 64)
    caches = allocate_kv_caches(spec, [f"model.layers.{i}.self_attn.attn" for i in range(4)])
    desc = describe([(spec, caches)])

    def owned() -> str:
        return f"kvd-{os.getpid()}-n{shm.pid_namespace()}-{uuid.uuid4().hex[:12]}"

    loose, missing = owned(), owned()
    with open(os.path.join(shm.SHM_DIR, loose), "wb") as f:
        f.write(b"\0" * 4096)
    try:
        with grpc.insecure_channel(p.grpc) as ch:
            stub = pbg.WorkerStub(ch)

            def register(alive: str) -> pb.RegisterResponse:
                return stub.Register(pb.RegisterRequest(worker=pb.WorkerId(engine_id="prefill", tp_size=1, pp_size=1),
                                                        model=pb.ModelInfo(num_layers=4, total_num_kv_heads=4), regions=desc.regions,
                                                        groups=desc.groups, alive_shm=alive), timeout=30)

            for alive, code, why in [(loose, "INVALID_ARGUMENT", "is not held locked"), ("../etc/passwd", "INVALID_ARGUMENT", "must be a bare name"),
                                     ("notkvd", "INVALID_ARGUMENT", "must name a page kvd.caches.alive_token made")]:
                with pytest.raises(grpc.RpcError) as e:
                    register(alive)
                assert e.value.code().name == code, (alive, e.value.code(), e.value.details())
                assert "alive_shm" in e.value.details() and alive in e.value.details() and why in e.value.details(), e.value.details()
            # Out of sight: registered, and said so.
            assert register(missing).registration_generation > 0
            assert f"registers without its alive token alive_shm={missing!r}: No such file or directory here" in p.log()
            # The daemon serves on, and the worker's own token registers.
            assert register(alive_token()).registration_generation > 0
    finally:
        shm.unlink_name(loose)
