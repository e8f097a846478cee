"""The engine's scheduler publishes for every rank at once (``PublishEngine``):
real daemons, real gRPC, real shared memory."""

from __future__ import annotations

import secrets

import pytest

from kvd.client import KvdClient, daemon_status
from kvd.core.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from kvd.core.spec import WorkerId
from tests.conftest import make_worker, scheduler_params, scrape


def _scheduler(address: str, engine_id: str, token: bytes) -> KvdClient:
    """The client an engine's scheduler holds: no rank of its own, a worker's token."""
    client = KvdClient(address, WorkerId(engine_id))
    client.worker_token = token
    return client


def test_the_scheduler_publishes_every_rank_at_once_and_decode_needs_no_resolve(daemons):
    p, d = daemons.start("prefill"), daemons.start("decode")
    pw = [make_worker(p.grpc, "prefill", tp_rank=r, tp_size=2) for r in range(2)]
    dw = make_worker(d.grpc, "decode")  # TP1: reads both of P's ranks
    sched = _scheduler(p.grpc, "prefill", pw[1].client.worker_token)
    for w in pw:
        w.fill(3, [4, 9, 2])
    cap = secrets.token_bytes(32)
    params = sched.publish_engine("r1", [[4, 9, 2]], 40, capability=cap)
    assert params.generation > 0 and params.remote_epoch and params.capability == cap
    assert (params.remote_tp_size, params.remote_pp_size) == (2, 1)
    dw.client.pull("r1", params, [[10, 11, 12]])
    f = dw.client.wait_finished(recving={"r1"}, timeout=30)
    assert f.details[("recving", "r1")].outcome == "done", f.details[("recving", "r1")]
    assert dw.mismatch(3, [10, 11, 12], 40) is None
    assert dw.mismatch(4, [10, 11, 12], 40) is not None  # the check compares bytes
    # Each rank's worker hears its blocks are free, as if it had published them.
    for w in pw:
        assert "r1" in w.client.wait_finished(sending={"r1"}, timeout=10).finished_sending
    assert scrape(d.metrics_url, "kvd_pull_phase_seconds_count", phase="resolve") == 0
    # Control: the same publication pulled with params made before it (generation 0) is resolved first.
    for w in pw:
        w.fill(5, [6])
    sched.publish_engine("p-r2", [[6]], 16, capability=cap)
    dw.client.pull("r2", scheduler_params(p.grpc, "prefill", "p-r2", cap, [6], 16), [[20]])
    f = dw.client.wait_finished(recving={"r2"}, timeout=30)
    assert f.details[("recving", "r2")].outcome == "done" and dw.mismatch(5, [20], 16) is None
    assert scrape(d.metrics_url, "kvd_pull_phase_seconds_count", phase="resolve") == 1


def test_an_engine_publish_is_refused_by_name_and_publishes_nothing_unless_every_rank_is_here(daemons):
    p = daemons.start("prefill")
    pw = make_worker(p.grpc, "prefill", tp_rank=0, tp_size=2)  # rank 1 has not registered
    token = pw.client.worker_token
    with pytest.raises(PermissionDenied, match="kvd-worker-token"):
        _scheduler(p.grpc, "prefill", b"").publish_engine("r", [[1]], 16)
    with pytest.raises(PermissionDenied, match="kvd-worker-token"):
        _scheduler(p.grpc, "prefill", secrets.token_bytes(len(token))).publish_engine("r", [[1]], 16)
    with pytest.raises(InvalidArgument, match=r"engine_id.*other"):
        _scheduler(p.grpc, "other", token).publish_engine("r", [[1]], 16)
    with pytest.raises(FailedPrecondition, match="only 1 of the 2 ranks of engine 'prefill'"):
        _scheduler(p.grpc, "prefill", token).publish_engine("r", [[1]], 16)
    assert daemon_status(p.grpc).publications == 0
    make_worker(p.grpc, "prefill", tp_rank=1, tp_size=2)
    sched = _scheduler(p.grpc, "prefill", token)
    with pytest.raises(InvalidArgument, match="num_tokens"):
        sched.publish_engine("r", [[1]], 0)
    with pytest.raises(InvalidArgument, match=r"block_ids\[0\]"):
        sched.publish_engine("r", [[1, 64]], 32)  # block 64 of 64
    assert daemon_status(p.grpc).publications == 0
    # Still serving: a good one goes through, once.
    assert sched.publish_engine("r", [[1]], 16).generation > 0
    assert daemon_status(p.grpc).publications == 1
    with pytest.raises(FailedPrecondition, match="already published"):
        sched.publish_engine("r", [[1]], 16)


def test_a_worker_registering_with_a_restarted_daemon_keeps_its_token_so_the_scheduler_still_publishes(tmp_path):
    """vLLM's scheduler learns a worker's token once, at startup (the
    connector handshake). When the daemon restarts and the worker registers
    again, it proposes the token it was first given and the new daemon adopts
    it (the rank is not registered there): the scheduler keeps publishing
    for the engine."""
    import signal

    from tests.conftest import Daemons, free_port

    ds = Daemons(tmp_path)
    port = free_port()
    try:
        p = ds.start("prefill", grpc_port=port)
        pw = make_worker(p.grpc, "prefill")
        first = pw.client.worker_token
        sched = _scheduler(p.grpc, "prefill", first)
        assert sched.publish_engine("r1", [[1, 2]], 32).generation > 0
        assert p.stop(signal.SIGTERM) == 0
        p = ds.start("prefill", grpc_port=port)  # a new daemon, on the same port
        assert daemon_status(p.grpc).epoch
        with pytest.raises(PermissionDenied):  # until the worker is back, the old token means nothing here
            sched.publish_engine("r2", [[1, 2]], 32)
        pw.register()
        assert pw.client.worker_token == first
        assert sched.publish_engine("r3", [[1, 2]], 32).generation > 0
        # Controls: another worker process gets a token of its own, and a token nobody holds is refused.
        other = make_worker(p.grpc, "prefill")  # the same rank, registering anew: replaces the registration
        assert other.client.worker_token != first
        with pytest.raises(PermissionDenied):
            sched.publish_engine("r4", [[1, 2]], 32)
        # Proposing a token is no way to take one: with the rank registered under another, a new one is issued.
        thief = make_worker(p.grpc, "prefill", register=False)
        thief.client._first_token = first
        thief.register()
        assert thief.client.worker_token not in (first, other.client.worker_token)
        with pytest.raises(PermissionDenied):
            sched.publish_engine("r5", [[1, 2]], 32)
        # A proposed token is one a daemon issued: 32 bytes.
        other.client._first_token = b"short"
        with pytest.raises(InvalidArgument, match="worker_token"):
            other.register()
    finally:
        ds.kill_all()
