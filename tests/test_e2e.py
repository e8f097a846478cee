"""The full path through real daemons: real processes, gRPC on loopback, shm."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvd.core.errors import InvalidArgument, KvdError
from kvd.proto import kvd_pb2 as pb
from kvd.proto import kvd_pb2_grpc as pbg
from kvd.regions.shm import pid_alive
from tests.conftest import REPO, free_port, make_worker, scheduler_params, scrape, transfer


def test_full_path_is_byte_exact_and_reports_finished_sets(daemons):
    p, d = daemons.start("prefill"), daemons.start("decode")
    pw = [make_worker(p.grpc, "prefill", tp_rank=r, tp_size=2) for r in range(2)]
    dw = [make_worker(d.grpc, "decode", tp_rank=r, tp_size=2) for r in range(2)]
    requests = [("a", 1, [1, 2, 3], [10, 11, 12], 40), ("b", 2, [7, 4, 9, 20], [3, 30, 31, 5], 64), ("c", 3, [5], [50], 1)]
    for rid, seed, p_ids, d_ids, ntok in requests:
        _, finished = transfer(pw, dw, rid, seed, p_ids, d_ids, ntok)
        for w, f in zip(dw, finished, strict=True):
            assert f.invalid_block_ids == set()
            assert f.details[("recving", rid)].outcome == "done"
            assert w.mismatch(seed, d_ids, ntok) is None
    # P reports every request as sent once D acknowledged it.
    for w in pw:
        f = w.client.wait_finished(sending={"a", "b", "c"}, timeout=10)
        assert {"a", "b", "c"} <= f.finished_sending
    # Bytes crossed the data plane, not gRPC: the counters match the blocks moved.
    expected = sum(len(r[3]) for r in requests) * dw[0].spec.bytes_per_block_per_layer * 4 * 2
    assert scrape(d.metrics_url, "kvd_received_bytes_total", transport="tcp") == expected


def test_a_wrong_seed_is_detected(daemons):
    """Negative control: verification really compares bytes."""
    p, d = daemons.start("prefill"), daemons.start("decode")
    pw, dw = make_worker(p.grpc, "prefill"), make_worker(d.grpc, "decode")
    transfer([pw], [dw], "r", 5, [1, 2], [3, 4], 32)
    assert dw.mismatch(5, [3, 4], 32) is None
    assert dw.mismatch(6, [3, 4], 32) is not None


def test_decode_daemon_restart_between_requests(daemons):
    p, d = daemons.start("prefill"), daemons.start("decode")
    pw, dw = make_worker(p.grpc, "prefill"), make_worker(d.grpc, "decode")
    transfer([pw], [dw], "r1", 1, [1, 2], [1, 2], 32)
    assert d.stop() == 0
    d2 = daemons.start("decode")
    dw2 = make_worker(d2.grpc, "decode")
    _, (f,) = transfer([pw], [dw2], "r2", 2, [3, 4], [5, 6], 32)
    assert f.details[("recving", "r2")].outcome == "done"
    assert dw2.mismatch(2, [5, 6], 32) is None


@pytest.mark.faults
def test_prefill_daemon_restart_fails_old_params_cleanly_and_serves_new(daemons):
    # P on a port picked below the ephemeral range: the new P takes it again (a port the kernel gave could be reused meanwhile).
    p, d = daemons.start("prefill", grpc_port=free_port()), daemons.start("decode")
    pw, dw = make_worker(p.grpc, "prefill"), make_worker(d.grpc, "decode")
    transfer([pw], [dw], "r1", 1, [1, 2], [1, 2], 32)
    pw.fill(2, [3, 4])
    old_params = pw.client.publish("r2", [[3, 4]], 32)
    port = int(p.grpc.rsplit(":", 1)[1])
    assert p.stop() == 0
    p2 = daemons.start("prefill", grpc_port=port)
    pw2 = make_worker(p2.grpc, "prefill")
    # The old publication died with the old daemon: the pull fails, naming every local block.
    dw.client.pull("r2", old_params, [[7, 8]])
    f = dw.client.wait_finished(recving={"r2"}, timeout=30)
    assert f.details[("recving", "r2")].outcome == "failed"
    assert "restarted" in f.details[("recving", "r2")].reason
    assert f.invalid_block_ids == {7, 8}
    # New work for the new epoch goes through.
    _, (f2,) = transfer([pw2], [dw], "r3", 3, [5, 6], [9, 10], 32)
    assert f2.details[("recving", "r3")].outcome == "done"
    assert dw.mismatch(3, [9, 10], 32) is None


def _register_raw(address, req):
    with grpc.insecure_channel(address) as ch:
        return pbg.WorkerStub(ch).Register(req, timeout=10)


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda r: setattr(r.worker, "engine_id", "other"), "worker.engine_id"),
        (lambda r: r.regions[0].shm.__setattr__("name", "../etc/passwd"), "shm.name"),
        (lambda r: r.regions[0].shm.__setattr__("name", "/dev/shm/x"), "shm.name"),
        (lambda r: r.regions[0].shm.__setattr__("name", "kvd-does-not-exist"), "shm.name"),
        (lambda r: r.regions[0].__setattr__("size_bytes", r.regions[0].size_bytes * 4), "size_bytes"),
        (lambda r: r.groups[0].layers[0].tensors[0].shape.__setitem__(1, 999), "shape[block]"),
        (lambda r: r.groups[0].layers[0].tensors[0].__setattr__("offset_bytes", 1 << 40), "tensor.shape"),
        (lambda r: r.groups[0].layers[0].tensors[0].__setattr__("region_id", "nope"), "region_id"),
        (lambda r: r.groups[0].spec.__setattr__("dtype", "complex64"), "spec.dtype"),
        (lambda r: r.groups[0].spec.layout.__setitem__(0, "bogus"), "spec.layout"),
        (lambda r: r.model.__setattr__("num_layers", 0), "model.num_layers"),
        (lambda r: r.worker.__setattr__("tp_rank", 5), "worker.tp_rank"),
        (lambda r: r.groups[0].layers[0].tensors[0].stride.__setitem__(0, 1), "stride"),
    ],
)
@pytest.mark.security
def test_bad_registrations_are_refused_naming_the_field(daemons, mutate, field):
    from kvd.caches import describe

    d = daemons.start("decode")
    w = make_worker(d.grpc, "decode", register=False)
    desc = describe([(w.spec, w.caches)])
    req = pb.RegisterRequest(worker=pb.WorkerId(engine_id="decode", tp_size=1, pp_size=1), model=pb.ModelInfo(num_layers=4, total_num_kv_heads=4), regions=desc.regions, groups=desc.groups)
    mutate(req)
    with pytest.raises(grpc.RpcError) as e:
        _register_raw(d.grpc, req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert field in e.value.details()
    # The daemon keeps serving: a good registration still works.
    assert w.register().registered_bytes > 0


@pytest.mark.security
def test_symlinked_shm_name_is_refused(daemons, tmp_path):
    from kvd.caches import describe

    d = daemons.start("decode")
    w = make_worker(d.grpc, "decode", register=False)
    desc = describe([(w.spec, w.caches)])
    link = f"kvd-link-{os.getpid()}"
    os.symlink(f"/dev/shm/{desc.regions[0].shm.name}", f"/dev/shm/{link}")
    try:
        desc.regions[0].shm.name = link
        req = pb.RegisterRequest(worker=pb.WorkerId(engine_id="decode", tp_size=1, pp_size=1), model=pb.ModelInfo(num_layers=4, total_num_kv_heads=4), regions=desc.regions, groups=desc.groups)
        with pytest.raises(grpc.RpcError) as e:
            _register_raw(d.grpc, req)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert link in e.value.details()
    finally:
        os.unlink(f"/dev/shm/{link}")


@pytest.mark.parametrize(
    "decode_kwargs, field",
    [
        (dict(head_size=32), "head_size"),
        (dict(dtype="float16"), "dtype"),
        (dict(layers=6), "num_layers"),
        (dict(heads=8), "total_num_kv_heads"),
    ],
)
def test_incompatible_handshake_is_refused_naming_both_values(daemons, decode_kwargs, field):
    p, d = daemons.start("prefill"), daemons.start("decode")
    pw = make_worker(p.grpc, "prefill")
    dw = make_worker(d.grpc, "decode", **decode_kwargs)
    params = pw.client.publish("r", [[1]], 16)
    dw.client.pull("r", params, [[1]])
    f = dw.client.wait_finished(recving={"r"}, timeout=30)
    detail = f.details[("recving", "r")]
    assert detail.outcome == "failed" and f.invalid_block_ids == {1}
    assert field in detail.reason and "local=" in detail.reason and "remote=" in detail.reason
    # And the Handshake RPC itself answers FAILED_PRECONDITION.
    from kvd.daemon.daemon import Daemon  # noqa: F401  (the message format is the daemon's)

    with grpc.insecure_channel(d.grpc) as ch:
        me = pbg.PeerStub(ch)
        with grpc.insecure_channel(p.grpc) as pch:
            pass
        del me, pch


def test_handshake_rpc_refuses_with_failed_precondition(daemons):
    p = daemons.start("prefill")
    make_worker(p.grpc, "prefill")
    caller = pb.EngineInfo(engine_id="decode", epoch="e", tp_size=1, pp_size=1, model=pb.ModelInfo(num_layers=4, total_num_kv_heads=2))
    caller.ranks.add(tp_rank=0, pp_rank=0).groups.add(group_id=0, spec=pb.KVCacheSpec(block_size=16, num_kv_heads=2, head_size=16, dtype="bfloat16", layout=["kv", "block", "token", "head", "dim"], num_blocks=8))
    caller.ranks[0].groups[0].layers.add(name="l0", layer_index=0)
    with grpc.insecure_channel(p.grpc) as ch, pytest.raises(grpc.RpcError) as e:
        pbg.PeerStub(ch).Handshake(pb.HandshakeRequest(caller=caller), timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "local=4" in e.value.details() and "remote=2" in e.value.details()


@pytest.mark.security
def test_unpublished_blocks_are_never_served(daemons):
    p, d = daemons.start("prefill"), daemons.start("decode")
    pw, dw = make_worker(p.grpc, "prefill"), make_worker(d.grpc, "decode")
    params = pw.client.publish("r", [[1, 2]], 32)
    forged = pb.TransferParams()
    forged.CopyFrom(params)
    forged.block_ids[0].ids[:] = [1, 3]  # block 3 was never published
    dw.client.pull("r", forged, [[5, 6]])
    f = dw.client.wait_finished(recving={"r"}, timeout=30)
    assert f.details[("recving", "r")].outcome == "failed"
    assert "published for request_id=" in f.details[("recving", "r")].reason and "not" in f.details[("recving", "r")].reason
    forged.capability = b"\0" * 32
    forged.block_ids[0].ids[:] = [1, 2]
    dw.client.pull("r", forged, [[5, 6]])
    f = dw.client.wait_finished(recving={"r"}, timeout=30)
    assert "capability" in f.details[("recving", "r")].reason


def test_serve_starts_reports_health_and_stops_cleanly_on_sigterm(daemons):
    d = daemons.start("decode")
    with grpc.insecure_channel(d.grpc) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        st = pbg.AdminStub(ch).Status(pb.StatusRequest(), timeout=5)
        assert st.engine_id == "decode"
    assert "kvd serving engine_id=decode" in d.log()
    t0 = time.monotonic()
    assert d.stop(signal.SIGTERM) == 0
    assert time.monotonic() - t0 < 15
    assert "kvd stopped" in d.log()


def test_serve_refuses_a_bad_engine_id():
    r = subprocess.run([sys.executable, "-m", "kvd", "serve", "--engine-id", "bad id!"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 2
    assert "engine-id" in r.stderr and "bad id!" in r.stderr


def test_pull_with_bad_input_gets_invalid_argument(daemons):
    d = daemons.start("decode")
    dw = make_worker(d.grpc, "decode")
    params = pb.TransferParams(remote_engine_id="prefill", remote_address="127.0.0.1:1", request_id="r", num_tokens=16, block_ids=[pb.BlockIds(ids=[1])])
    with pytest.raises(InvalidArgument, match=r"local_block_ids\[0\]=9999"):
        dw.client.pull("r", params, [[9999]])
    with pytest.raises(KvdError):
        dw.client.pull("r", pb.TransferParams(remote_engine_id="", num_tokens=1), [[1]])


def test_demo_command_verifies(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvd", "demo", "--requests", "24", "--layers", "2", "--num-blocks", "512", "--max-tokens", "256"],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "verified" in r.stdout and "failures       0" in r.stdout


def _daemons_of(pid: int) -> list[int]:
    """The ``kvd serve`` children of process ``pid``."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat, cmdline = Path(f"/proc/{entry}/stat").read_text(), Path(f"/proc/{entry}/cmdline").read_bytes()
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"kvd\0serve" in cmdline:
                found.append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    return found


def test_a_demo_killed_with_sigkill_leaves_no_daemon_behind():
    """``kvd demo`` (and ``kvd bench``) start their own daemons; killed without a chance to stop them
    (kill -9, the OOM killer), it used to leave both serving, holding ports and mapped memory."""
    demo = subprocess.Popen([sys.executable, "-m", "kvd", "demo", "--requests", "1000000", "--layers", "2"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(started := _daemons_of(demo.pid)) < 2 and time.monotonic() < deadline and demo.poll() is None:
            time.sleep(0.2)
        assert len(started) == 2, f"the demo started {started} (exit {demo.poll()})"
        time.sleep(3)  # serving: they drain on SIGTERM
        demo.kill()
        demo.wait()
        deadline = time.monotonic() + 30
        while (alive := [p for p in started if pid_alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive, f"daemons {alive} outlived their demo"
    finally:
        demo.kill()
        for p in started:
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)


def test_reregistration_replaces_stale_regions_and_publications(daemons):
    p, d = daemons.start("prefill"), daemons.start("decode")
    pw, dw = make_worker(p.grpc, "prefill"), make_worker(d.grpc, "decode")
    pw.fill(1, [1, 2])
    old_params = pw.client.publish("old", [[1, 2]], 32)
    # The worker restarts: new memory, same rank.
    pw2 = make_worker(p.grpc, "prefill")
    with grpc.insecure_channel(p.grpc) as ch:
        st = pbg.AdminStub(ch).Status(pb.StatusRequest(), timeout=5)
    assert len(st.workers) == 1 and st.publications == 0
    f = pw2.client.wait_finished(sending={"old"}, timeout=10)
    assert f.details[("sending", "old")].outcome == "aborted"
    dw.client.pull("old", old_params, [[3, 4]])
    assert dw.client.wait_finished(recving={"old"}).details[("recving", "old")].outcome == "failed"
    pw2.fill(2, [1, 2])
    params = pw2.client.publish("new", [[1, 2]], 32)
    dw.client.pull("new", params, [[3, 4]])
    dw.client.wait_finished(recving={"new"})
    assert dw.mismatch(2, [3, 4], 32) is None  # served from the new memory



def test_a_same_host_reader_never_copies_memory_its_owner_left(daemons):
    """The worker restarts and registers new memory: the reader's mapping of
    the old memory is stale. The owner refuses a local read that names the
    old registration, and the reader handshakes again and copies the new
    memory. The old memory is changed too, so a stale copy would show."""
    p, d = daemons.start("prefill", same_host="auto"), daemons.start("decode", same_host="auto")
    pw, dw = make_worker(p.grpc, "prefill"), make_worker(d.grpc, "decode")
    pw.fill(1, [1, 2])
    dw.client.pull("first", pw.client.publish("first", [[1, 2]], 32), [[3, 4]])
    assert dw.client.wait_finished(recving={"first"}).details[("recving", "first")].outcome == "done"
    assert dw.mismatch(1, [3, 4], 32) is None
    pw2 = make_worker(p.grpc, "prefill")  # the same rank, new memory
    pw2.fill(2, [1, 2])
    pw.fill(3, [1, 2])  # what a stale mapping would copy
    dw.client.pull("new", pw2.client.publish("new", [[1, 2]], 32), [[5, 6]])
    f = dw.client.wait_finished(recving={"new"})
    assert f.details[("recving", "new")].outcome == "done", f.details
    assert dw.mismatch(2, [5, 6], 32) is None
    assert scrape(d.metrics_url, "kvd_received_bytes_total", transport="samehost") > 0  # it stayed on the same-host path

@pytest.mark.parametrize(("same_host", "flags"), [("off", ()), ("off", ("--stripes-per-read", "3", "--stripe-min-bytes", "1", "--segment-bytes", "65536")), ("auto", ())],
                         ids=["tcp", "tcp-striped", "samehost"])
def test_every_transport_is_byte_exact_with_several_connections(daemons, same_host, flags):
    p = daemons.start("prefill", same_host=same_host)
    d = daemons.start("decode", "--connections-per-peer", "3", *flags, same_host=same_host)
    pw = [make_worker(p.grpc, "prefill", tp_rank=r, tp_size=2, layout="HND") for r in range(2)]
    dw = make_worker(d.grpc, "decode", tp_rank=0, tp_size=1, layout="NHD")
    import random

    rng = random.Random(1)
    rids = []
    for i in range(12):
        n = rng.randint(1, 20)
        p_ids = rng.sample(range(1, 64), n)
        d_ids = rng.sample(range(1, 64), n)
        cap = secrets.token_bytes(32)
        params = None
        for w in pw:
            w.fill(100 + i, p_ids)
            params = w.client.publish(f"r{i}", [p_ids], n * 16, capability=cap)
        dw.client.pull(f"r{i}", params, [d_ids])
        rids.append((f"r{i}", 100 + i, d_ids, n * 16))
        f = dw.client.wait_finished(recving={f"r{i}"}, timeout=30)
        assert f.details[("recving", f"r{i}")].outcome == "done"
        assert dw.mismatch(100 + i, d_ids, n * 16) is None
    # P ends each publication only once every read (every stripe of it) was ACKed.
    for w in pw:
        sent = w.client.wait_finished(sending={rid for rid, *_ in rids}, timeout=30)
        assert all(sent.details[("sending", rid)].outcome == "done" for rid, *_ in rids)
    label = "tcp" if same_host == "off" else "samehost"
    assert scrape(d.metrics_url, "kvd_received_bytes_total", transport=label) > 0
    reads = scrape(d.metrics_url, "kvd_data_reads_total", transport=label)
    assert reads > 2 * len(rids) if flags else reads == 2 * len(rids)  # two P ranks each; striped reads are several



@pytest.mark.parametrize(("layout", "in_place"), [("NHD", True), ("HND", False)], ids=["wire-order", "relayout"])
def test_a_read_in_wire_order_moves_in_its_own_frame_size(daemons, layout, in_place):
    """Where D holds P's layout, a TCP read lands in place and takes frames of
    in_place_segment_bytes; a read D relays out keeps segment_bytes (the
    control). P counts a block once per frame that carries it."""
    p = daemons.start("prefill")
    d = daemons.start("decode", "--segment-bytes", "8192", "--in-place-segment-bytes", str(1 << 20))
    pw = make_worker(p.grpc, "prefill")  # NHD, 4 layers of 4 KiB blocks
    dw = make_worker(d.grpc, "decode", layout=layout)
    p_ids, d_ids = [9, 3, 40, 17, 22, 5, 31, 60], [2, 50, 7, 33, 12, 44, 1, 28]
    pw.fill(7, p_ids)
    dw.client.pull("r", pw.client.publish("r", [p_ids], 128), [d_ids])
    f = dw.client.wait_finished(recving={"r"}, timeout=30)
    assert f.details[("recving", "r")].outcome == "done"
    assert dw.mismatch(7, d_ids, 128) is None
    sent = scrape(p.metrics_url, "kvd_sent_blocks_total", transport="tcp")
    # 8 blocks x 4 layers x 4 KiB: one 128 KiB frame, or 8 KiB ones of 2 layers of one block.
    assert sent == (len(p_ids) if in_place else 2 * len(p_ids)), sent


def test_params_made_before_publish_are_resolved_once_every_rank_published(daemons):
    p, d = daemons.start("prefill"), daemons.start("decode")
    pw = [make_worker(p.grpc, "prefill", tp_rank=r, tp_size=2) for r in range(2)]
    dw = make_worker(d.grpc, "decode")
    cap = secrets.token_bytes(32)
    for w in pw:
        w.fill(4, [2, 3])
    # D pulls first; P's ranks publish later, one after the other.
    dw.client.pull("d-req", scheduler_params(p.grpc, "prefill", "p-req", cap, [2, 3], 32), [[6, 7]])
    time.sleep(0.3)
    pw[0].client.publish("p-req", [[2, 3]], 32, capability=cap)
    time.sleep(0.3)
    assert dw.client.get_finished().finished_recving == set()  # still waiting for rank 1
    pw[1].client.publish("p-req", [[2, 3]], 32, capability=cap)
    f = dw.client.wait_finished(recving={"d-req"}, timeout=20)
    assert f.details[("recving", "d-req")].outcome == "done", f.details[("recving", "d-req")]
    assert dw.mismatch(4, [6, 7], 32) is None
    for w in pw:
        assert "p-req" in w.client.wait_finished(sending={"p-req"}, timeout=10).finished_sending


def test_unresolvable_params_fail_after_the_publish_wait_with_every_block_invalid(daemons):
    p, d = daemons.start("prefill", "--publish-wait-seconds", "0.5"), daemons.start("decode", "--publish-wait-seconds", "0.5")
    pw, dw = make_worker(p.grpc, "prefill"), make_worker(d.grpc, "decode")
    pw.fill(1, [1])
    pw.client.publish("p-req", [[1]], 16, capability=secrets.token_bytes(32))
    # A capability nobody published: refused after the wait, never read.
    dw.client.pull("d-req", scheduler_params(p.grpc, "prefill", "p-req", secrets.token_bytes(32), [1], 16), [[5]])
    f = dw.client.wait_finished(recving={"d-req"}, timeout=20)
    detail = f.details[("recving", "d-req")]
    assert detail.outcome == "failed"
    assert "matches this capability" in detail.reason + " " + str(detail)
    assert f.invalid_block_ids == {5}


def test_params_of_a_publication_that_ended_fail_at_once_saying_how(daemons):
    """P aborted its publication before D resolved the params (made before
    publish, as vLLM's scheduler makes them): D hears the abort at once,
    not a capability refusal after the whole publish wait."""
    p, d = daemons.start("prefill", "--publish-wait-seconds", "20"), daemons.start("decode", "--publish-wait-seconds", "20")
    pw, dw = make_worker(p.grpc, "prefill"), make_worker(d.grpc, "decode")
    cap = secrets.token_bytes(32)
    pw.client.publish("p-req", [[1, 2]], 32, capability=cap)
    assert pw.client.abort("p-req")
    params = scheduler_params(p.grpc, "prefill", "p-req", cap, [1, 2], 32)
    params.remote_tp_size = 1
    t0 = time.monotonic()
    dw.client.pull("d-req", params, [[5, 6]])
    f = dw.client.wait_finished(recving={"d-req"}, timeout=30)
    detail = f.details[("recving", "d-req")]
    assert detail.outcome == "failed" and "ended before this read: aborted" in detail.reason, detail
    assert time.monotonic() - t0 < 10 and f.invalid_block_ids == {5, 6}
    # Negative control: another capability for the same request id learns
    # nothing of it, and waits for a publish as before.
    params.capability = secrets.token_bytes(32)
    dw.client.pull("d-req2", params, [[7, 8]])
    time.sleep(2)
    assert "d-req2" not in dw.client.get_finished().finished_recving
    assert dw.client.abort("d-req2")


def test_a_reader_that_needs_nothing_releases_the_publication_at_once(daemons):
    """D already holds the prompt (a prefix-cache hit): P frees the blocks now, not at lease expiry."""
    p, d = daemons.start("prefill"), daemons.start("decode")
    pw, dw = make_worker(p.grpc, "prefill"), make_worker(d.grpc, "decode")
    cap = secrets.token_bytes(32)
    pw.client.publish("p-req", [[1, 2]], 32, capability=cap, lease_seconds=60)
    release = scheduler_params(p.grpc, "prefill", "p-req", cap, [1, 2], 32)
    assert dw.client.abort("d-req", release=release)
    f = pw.client.wait_finished(sending={"p-req"}, timeout=10)
    assert f.details[("sending", "p-req")].outcome == "aborted"
    # A wrong capability releases nothing.
    pw.client.publish("p-req2", [[3]], 16, capability=cap, lease_seconds=60)
    assert dw.client.abort("d-req2", release=scheduler_params(p.grpc, "prefill", "p-req2", secrets.token_bytes(32), [3], 16))
    time.sleep(1.0)
    assert "p-req2" not in pw.client.get_finished().finished_sending
