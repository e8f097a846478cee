"""Finished sets pushed to the worker (WatchFinished + FinishedFeed): real daemons, real gRPC."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest

from kvd.client import FinishedFeed, KvdClient
from kvd.errors import KvdError, Unavailable
from kvd.proto import kvd_pb2 as pb
from kvd.proto import kvd_pb2_grpc as pbg
from tests.conftest import make_worker
from tests.faultproxy import FaultProxy

LAYERS = 4  # make_worker's default


def pulls_in_flight(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return pbg.AdminStub(ch).Status(pb.StatusRequest(), timeout=5).pulls_in_flight


def wait_pulls_done(address: str, timeout: float = 30) -> None:
    """Until the daemon has emitted every pull's outcome (into the worker's box), without draining it."""
    deadline = time.monotonic() + timeout
    while pulls_in_flight(address):
        assert time.monotonic() < deadline, "pull still in flight"
        time.sleep(0.02)


def forged(params: pb.TransferParams) -> pb.TransferParams:
    """The same publication under a capability nobody issued: P refuses the read."""
    bad = pb.TransferParams()
    bad.CopyFrom(params)
    bad.capability = b"\0" * 32
    return bad


@pytest.fixture
def pair(daemons):
    p, d = daemons.start("prefill"), daemons.start("decode")
    return p, d, make_worker(p.grpc, "prefill"), make_worker(d.grpc, "decode")


def test_a_pulls_outcome_reaches_the_feed_with_no_get_finished_call(pair, monkeypatch):
    _p, _d, pw, dw = pair

    def no_polling() -> None:
        raise AssertionError("the feed must not call GetFinished")

    monkeypatch.setattr(dw.client, "get_finished", no_polling)
    feed = FinishedFeed(dw.client).start()
    try:
        assert feed.subscribed.wait(10)
        pw.fill(7, [1, 2])
        params = pw.client.publish("ok", [[1, 2]], 32)
        dw.client.pull("ok", params, [[3, 4]])
        f = feed.wait_finished(recving={"ok"}, timeout=30)
        assert f.finished_recving == {"ok"} and f.invalid_block_ids == set()
        detail = f.details[("recving", "ok")]
        assert detail.outcome == "done"
        assert detail.bytes == 2 * dw.spec.bytes_per_block_per_layer * LAYERS
        assert dw.mismatch(7, [3, 4], 32) is None
        # A refused read: failed, naming exactly its local blocks as invalid.
        dw.client.pull("bad", forged(params), [[5, 6]])
        f = feed.wait_finished(recving={"bad"}, timeout=30)
        assert f.finished_recving == {"bad"} and f.details[("recving", "bad")].outcome == "failed"
        assert f.invalid_block_ids == {5, 6}
        assert feed.error is None
    finally:
        feed.close()


def test_each_outcome_is_delivered_once_backlog_first(pair):
    _p, d, pw, dw = pair
    pw.fill(1, [1, 2])

    def pull(rid: str, local: list[int]) -> None:
        dw.client.pull(rid, pw.client.publish(rid, [[1, 2]], 32), [local])

    # Negative control: with no feed running, GetFinished returns the outcome.
    pull("before", [3, 4])
    assert "before" in dw.client.wait_finished(recving={"before"}, timeout=30).finished_recving
    # An outcome emitted before the feed subscribes is its first message (the backlog).
    pull("backlog", [5, 6])
    wait_pulls_done(d.grpc)
    feed = FinishedFeed(dw.client).start()
    try:
        assert feed.subscribed.wait(10)
        assert feed.take().finished_recving == {"backlog"}
        pull("live", [7, 8])
        assert feed.wait_finished(recving={"live"}, timeout=30).finished_recving == {"live"}
        # Taken by the feed, so GetFinished has nothing left to give for either.
        left = dw.client.get_finished()
        assert left.finished_recving == set() and left.details == {} and left.invalid_block_ids == set()
    finally:
        feed.close()
    assert dw.mismatch(1, [5, 6, 7, 8], 32) is None


@pytest.fixture
def feed_via_proxy(pair):
    """The decode worker's feed over a connection the test can stall and cut."""
    _p, d, pw, dw = pair
    proxy = FaultProxy()
    proxy.target = ("127.0.0.1", int(d.grpc.rsplit(":", 1)[1]))
    via_proxy = KvdClient(proxy.address, dw.worker)
    via_proxy.worker_token = dw.client.worker_token  # the same worker, on another connection
    feed = FinishedFeed(via_proxy, reconnect_attempts=8).start()
    assert feed.subscribed.wait(10)
    yield d, pw, dw, proxy, feed
    feed.close()
    via_proxy.close()
    proxy.close()


def test_outcomes_emitted_while_the_stream_is_down_arrive_after_it_reconnects(feed_via_proxy):
    d, pw, dw, proxy, feed = feed_via_proxy
    proxy.refuse = True
    proxy.cut()
    pw.fill(2, [1, 2])
    dw.client.pull("meanwhile", pw.client.publish("meanwhile", [[1, 2]], 32), [[3, 4]])
    wait_pulls_done(d.grpc)  # emitted while no stream was open
    proxy.refuse = False
    f = feed.wait_finished(recving={"meanwhile"}, timeout=20)
    assert f.details[("recving", "meanwhile")].outcome == "done"
    assert feed.error is None


def test_a_push_lost_with_a_broken_connection_is_resent_on_resume(feed_via_proxy):
    d, pw, dw, proxy, feed = feed_via_proxy
    proxy.stall_after = proxy.forwarded  # the daemon's next bytes to the feed never arrive
    pw.fill(3, [1, 2])
    dw.client.pull("lost", pw.client.publish("lost", [[1, 2]], 32), [[3, 4]])
    wait_pulls_done(d.grpc)
    assert proxy.stalled.wait(10)  # pushed: the daemon's box no longer holds it
    proxy.cut()
    proxy.release()  # the stalled push goes into the closed connection
    f = feed.wait_finished(recving={"lost"}, timeout=20)
    assert f.details[("recving", "lost")].outcome == "done"
    assert dw.client.get_finished().finished_recving == set()  # once: resent, not left in the box
    assert feed.error is None


def test_a_killed_daemon_makes_the_feed_report_an_error_within_seconds(daemons):
    d = daemons.start("decode")
    dw = make_worker(d.grpc, "decode")
    feed = FinishedFeed(dw.client).start()
    try:
        assert feed.subscribed.wait(10) and feed.error is None
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait(10)
        while feed.error is None and time.monotonic() - t0 < 10:
            time.sleep(0.02)
        assert isinstance(feed.error, Unavailable), feed.error
        assert time.monotonic() - t0 < 5
        with pytest.raises(KvdError):
            feed.wait_finished(recving={"never"}, timeout=1)
    finally:
        feed.close()


def test_unregistering_ends_the_stream_and_the_feed_says_why(daemons):
    d = daemons.start("decode")
    dw = make_worker(d.grpc, "decode")
    feed = FinishedFeed(dw.client).start()
    try:
        assert feed.subscribed.wait(10)
        dw.client.unregister()
        deadline = time.monotonic() + 10
        while feed.error is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert feed.error is not None and "not registered" in feed.error.message
    finally:
        feed.close()


def test_a_pull_not_waited_for_lands_and_a_refused_one_says_why_on_its_callback(pair):
    """``pull_nowait``: the caller goes on at once; the daemon's answer comes
    to a callback: None for a pull it took (whose bytes land, its outcome
    pushed as any other), the error naming the field for one it refused
    (which then has no outcome at all), and the call's own failure when the
    daemon is gone. A stopped daemon holds up no caller."""
    _p, d, pw, dw = pair
    answers: dict[str, KvdError | None] = {}
    heard = threading.Condition()

    def answered(rid: str):
        def on(error: KvdError | None) -> None:
            with heard:
                answers[rid] = error
                heard.notify_all()
        return on

    def wait_answer(rid: str) -> KvdError | None:
        with heard:
            assert heard.wait_for(lambda: rid in answers, 30), f"no answer for {rid}"
            return answers[rid]

    feed = FinishedFeed(dw.client).start()
    try:
        assert feed.subscribed.wait(10)
        pw.fill(7, [1, 2])
        params = pw.client.publish("ok", [[1, 2]], 32)
        dw.client.pull_nowait("ok", params, [[3, 4]], answered=answered("ok"))
        assert wait_answer("ok") is None
        assert feed.wait_finished(recving={"ok"}, timeout=30).details[("recving", "ok")].outcome == "done"
        assert dw.mismatch(7, [3, 4], 32) is None
        assert dw.mismatch(8, [3, 4], 32) is not None  # the check compares bytes
        # Refused by D's daemon itself: params naming its own engine. Nothing is pulled or reported.
        own = pb.TransferParams()
        own.CopyFrom(params)
        own.remote_engine_id = "decode"
        dw.client.pull_nowait("own", own, [[5, 6]], answered=answered("own"))
        error = wait_answer("own")
        assert error is not None and error.code.name == "INVALID_ARGUMENT" and "params.remote_engine_id" in error.message, error
        assert pulls_in_flight(d.grpc) == 0 and "own" not in feed.take().finished_recving
        # A daemon that does not answer (stopped) holds up no caller; its answer comes once it runs again.
        pw.fill(9, [7])
        late = pw.client.publish("late", [[7]], 16)
        d.proc.send_signal(signal.SIGSTOP)
        try:
            # A call that waited for the answer would return only with it, or at its timeout (30 s), not before the
            # daemon runs again; the bound separates the two on a machine busy with other tests.
            t0 = time.monotonic()
            dw.client.pull_nowait("late", late, [[8]], answered=answered("late"))
            assert time.monotonic() - t0 < dw.client.timeout / 6 and "late" not in answers
            time.sleep(0.5)
            assert "late" not in answers  # (the control: the answer does wait for the daemon)
        finally:
            d.proc.send_signal(signal.SIGCONT)
        assert wait_answer("late") is None
        assert feed.wait_finished(recving={"late"}, timeout=30).details[("recving", "late")].outcome == "done"
        assert dw.mismatch(9, [8], 16) is None
    finally:
        feed.close()
    # The daemon gone: the call itself fails, and the callback hears it.
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait(10)
    dw.client.pull_nowait("gone", params, [[7]], answered=answered("gone"))
    error = wait_answer("gone")
    assert error is not None and error.code.name in ("UNAVAILABLE", "DEADLINE_EXCEEDED"), error
