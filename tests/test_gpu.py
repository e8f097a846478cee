"""GPU memory on the data plane: CUDA IPC registration, pinned staging on
CUDA streams, relayout on the GPU, and the same-host device copy.

Every test needs a CUDA device and is skipped without one.
"""

from __future__ import annotations

import pytest
import torch

from kvd.caches import allocate_kv_caches, local_group_tensors
from kvd.client import KvdClient
from kvd.core.relayout import GroupTensors
from kvd.core.spec import KVCacheSpec, ModelInfo, WorkerId, parse_layout
from kvd.testing import pattern
from kvd.transport.device import DeviceToHost, device_copies
from tests.conftest import local_group_tensors_plain, scrape

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LAYERS, HEADS = 4, 4


def _worker(address: str, engine: str, spec: KVCacheSpec, device: str) -> tuple[KvdClient, GroupTensors, dict[str, torch.Tensor]]:
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    if device == "cuda":
        buffer = torch.zeros(LAYERS, *spec.part_shape(), dtype=torch.bfloat16, device="cuda")
        caches = {name: buffer[i] for i, name in enumerate(names)}
        tensors = local_group_tensors_plain(spec, caches)
    else:
        caches = allocate_kv_caches(spec, names)
        tensors = local_group_tensors(spec, caches)
    client = KvdClient(address, WorkerId(engine))
    client.wait_ready()
    client.register(caches, ModelInfo(LAYERS, HEADS), spec)
    return client, tensors, caches


@pytest.mark.parametrize("same_host", ["off", "auto"])
@pytest.mark.parametrize(("p_device", "d_device", "d_layout", "d_block"), [
    ("cuda", "cuda", "NHD", 16),  # lands as-is: one upload per segment
    ("cuda", "cuda", "HND", 8),  # relayout and block-size split on the GPU
    ("cpu", "cuda", "HND", 16),
    ("cuda", "cpu", "NHD", 8),
])
def test_gpu_memory_moves_byte_exact(daemons, same_host: str, p_device: str, d_device: str, d_layout: str, d_block: int) -> None:
    p, d = daemons.start("prefill", same_host=same_host), daemons.start("decode", same_host=same_host)
    p_spec = KVCacheSpec(16, HEADS, 16, "bfloat16", parse_layout("NHD"), 64)
    d_spec = KVCacheSpec(d_block, HEADS, 16, "bfloat16", parse_layout(d_layout), 128)
    pc, p_tensors, _ = _worker(p.grpc, "prefill", p_spec, p_device)
    dc, d_tensors, _ = _worker(d.grpc, "decode", d_spec, d_device)
    p_ids = [3, 9, 4, 20, 21, 22, 40]  # scattered and runs
    tokens = len(p_ids) * 16 - 5
    d_ids = list(range(70, 70 + -(-tokens // d_block)))[::-1]
    pattern.fill(p_tensors, 11, p_ids, pattern.RankCoords(0))
    torch.cuda.synchronize()
    params = pc.publish("r", [p_ids], tokens)
    dc.pull("r", params, [d_ids])
    f = dc.wait_finished(recving={"r"}, timeout=60)
    assert f.details[("recving", "r")].outcome == "done", f.details
    # Landed means landed: no torch.cuda.synchronize() before looking.
    assert pattern.mismatch(d_tensors, 11, d_ids, pattern.RankCoords(0), tokens) is None
    assert scrape(d.metrics_url, "kvd_data_reads_total", transport="tcp" if same_host == "off" else "samehost") == 1


def test_device_to_host_keeps_two_segments_in_flight_and_their_bytes() -> None:
    device = torch.device("cuda")
    sizes = [1 << 20, 3 << 20, 5 << 10, 2 << 20, 4 << 20]
    sources = [torch.randint(0, 256, (n,), dtype=torch.uint8, device=device) for n in sizes]
    orders = [torch.randperm(n, device=device) for n in sizes]

    def gather(i: int):  # type: ignore[no-untyped-def]
        return lambda staging: torch.index_select(sources[i], 0, orders[i], out=staging(sizes[i], device))

    d2h = DeviceToHost()
    d2h.start(0, device, gather(0))
    got = []
    for i in range(len(sizes)):
        if i + 1 < len(sizes):
            d2h.start(i + 1, device, gather(i + 1))
        host = d2h.take(i)
        assert host.device.type == "cpu" and host.is_pinned()
        got.append(host.clone())
    for i, g in enumerate(got):
        assert torch.equal(g, sources[i][orders[i]].cpu()), f"segment {i}"
    with pytest.raises(RuntimeError, match="two segments"):
        for i in range(3):
            d2h.start(i, device, gather(i))
    d2h.drain()


def test_device_copies_run_on_a_side_stream_and_finish_inside() -> None:
    device = torch.device("cuda")
    src = torch.randn(8 << 20, device=device)
    dst = torch.empty_like(src)
    default = torch.cuda.current_stream(device)
    with device_copies(device):
        assert torch.cuda.current_stream(device) != default
        dst.copy_(src * 2, non_blocking=True)
    assert torch.cuda.current_stream(device) == default
    assert torch.cuda.current_stream(device).query()  # nothing left queued on the default stream either
    assert torch.equal(dst.cpu(), (src * 2).cpu())


def test_after_device_runs_each_call_once_the_stream_has_got_there() -> None:
    """The vLLM worker starts a load from inside the step through
    ``AfterDevice.run``: the call must not run before the GPU has done what
    the step enqueued ahead of it (vLLM's zeroing of the blocks the load
    lands in). A value the GPU writes after a long kernel is what the call
    sees; without the event (``cuda=False``) it runs at once and sees the old
    value (the negative control)."""
    import threading

    from kvd.client import AfterDevice

    dev = torch.zeros(1, dtype=torch.int32, device="cuda")
    host = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    seen: dict[bool, int] = {}
    for cuda in (True, False):
        after = AfterDevice(None, 1, cuda=cuda)  # type: ignore[arg-type]  # run() never calls the daemon
        done = threading.Event()
        host.zero_()
        dev.zero_()
        torch.cuda.synchronize()
        torch.cuda._sleep(1 << 30)  # about half a second of spinning at H100/H200 clocks
        dev.fill_(7)
        host.copy_(dev, non_blocking=True)  # lands in pinned memory, read below without a sync

        def look(cuda: bool = cuda, done: threading.Event = done) -> None:
            seen[cuda] = int(host[0])
            done.set()

        after.run(look)
        assert done.wait(30)
        torch.cuda.synchronize()
        after.close()
    assert seen == {True: 7, False: 0}, seen


@pytest.mark.parametrize(("piece", "misalign"), [(8 << 10, 0), (512 << 10, 0), (1000, 3)])
def test_device_piece_kernel_copies_exactly_the_pairs_it_is_given(piece: int, misalign: int) -> None:
    """The same-host GPU path's one kernel (``device_pieces``): every piece
    lands where its pair says, byte for byte, aligned (wide loads) or not;
    and nothing else is written (the pieces left out stay zero)."""
    import numpy as np

    from kvd.transport import device_pieces

    device = torch.device("cuda")
    assert device_pieces.available(device), "Triton comes with CUDA builds of torch"
    n = 64
    src = torch.randint(1, 256, ((n + 1) * piece,), dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    rng = np.random.default_rng(piece)
    s_at, d_at = rng.permutation(n)[: n - 8], rng.permutation(n)[: n - 8]  # 8 pieces left out
    base = np.uint64(misalign)
    device_pieces.copy_pairs(dst.data_ptr() + base + d_at.astype(np.uint64) * np.uint64(piece),
                             src.data_ptr() + base + s_at.astype(np.uint64) * np.uint64(piece), piece, device)
    torch.cuda.synchronize()
    want = torch.zeros_like(dst)
    for s, d in zip(s_at.tolist(), d_at.tolist(), strict=True):
        lo, hi = misalign + d * piece, misalign + (d + 1) * piece
        want[lo:hi] = src[misalign + s * piece : misalign + (s + 1) * piece]
    assert torch.equal(dst, want)
    assert int((dst != 0).sum()) == (n - 8) * piece  # the left-out pieces were not touched

