"""Bad input gets INVALID_ARGUMENT naming the field and the value, on every
call alike, and exactness holds where a request ends before a rank publishes
(real daemons, real gRPC)."""

from __future__ import annotations

import secrets
import time

import grpc
import pytest

from kvd.errors import InvalidArgument
from kvd.proto import kvd_pb2 as pb
from kvd.proto import kvd_pb2_grpc as pbg
from tests.conftest import make_worker, scheduler_params

pytestmark = pytest.mark.security


def test_a_block_id_published_twice_is_refused_naming_it(daemons):
    p = daemons.start("prefill")
    pw = make_worker(p.grpc, "prefill")
    with pytest.raises(InvalidArgument, match=r"block_ids\[0\]=3 is listed more than once"):
        pw.client.publish("r", [[1, 3, 2, 3]], 64)
    with pytest.raises(InvalidArgument, match=r"block_ids\[0\]=64 is outside the registered range \[0, 64\)"):
        pw.client.publish("r", [[1, 64, 2, 3]], 64)
    # Negative control: the same blocks once each are accepted.
    assert pw.client.publish("r", [[1, 3, 2, 4]], 64).generation > 0


def test_a_local_block_id_pulled_twice_is_refused_naming_it(daemons):
    p, d = daemons.start("prefill"), daemons.start("decode")
    pw, dw = make_worker(p.grpc, "prefill"), make_worker(d.grpc, "decode")
    pw.fill(1, [1, 2, 3])
    params = pw.client.publish("r", [[1, 2, 3]], 48)
    with pytest.raises(InvalidArgument, match=r"local_block_ids\[0\]=7 is listed more than once"):
        dw.client.pull("r", params, [[7, 8, 7]])
    with pytest.raises(InvalidArgument, match=r"local_block_ids\[0\]=70 is outside the registered range \[0, 64\)"):
        dw.client.pull("r", params, [[7, 70, 9]])
    dw.client.pull("r", params, [[7, 8, 9]])
    f = dw.client.wait_finished(recving={"r"}, timeout=20)
    assert f.details[("recving", "r")].outcome == "done" and dw.mismatch(1, [7, 8, 9], 48) is None


def test_a_publish_with_too_few_blocks_for_its_tokens_is_refused(daemons):
    p = daemons.start("prefill")
    pw = make_worker(p.grpc, "prefill")  # 16 tokens a block
    with pytest.raises(InvalidArgument, match=r"block_ids\[0\]='<2 blocks>' of 16 tokens from token 0 cannot hold num_tokens=33"):
        pw.client.publish("r", [[1, 2]], 33)
    assert pw.client.publish("r", [[1, 2]], 32).generation > 0


@pytest.mark.parametrize("request_id", ["", "x" * (1 << 20)], ids=["empty", "1MiB"])
def test_request_ids_are_checked_alike_on_every_call_and_long_ones_quoted_short(daemons, request_id):
    p, d = daemons.start("prefill"), daemons.start("decode")
    pw, dw = make_worker(p.grpc, "prefill"), make_worker(d.grpc, "decode")
    params = pw.client.publish("ok", [[1]], 16)
    calls = {
        "publish": lambda: pw.client.publish(request_id, [[2]], 16),
        "pull": lambda: dw.client.pull(request_id, params, [[5]]),
        "abort": lambda: dw.client.abort(request_id),
    }
    for name, call in calls.items():
        with pytest.raises(InvalidArgument) as e:
            call()
        assert "request_id=" in e.value.message and "must be 1-256 characters" in e.value.message, name
        assert len(e.value.message) < 300, (name, len(e.value.message))  # a prefix and the length, never the whole value
        if request_id:
            assert "(1048576 chars)" in e.value.message, name
    # The peer API applies the same rule.
    stub = pbg.PeerStub(grpc.insecure_channel(p.grpc))
    with pytest.raises(grpc.RpcError) as rpc:
        stub.Abort(pb.PeerAbortRequest(engine_id="prefill", request_id=request_id, capability=params.capability), timeout=10)
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, rpc.value.details()
    # The daemons keep serving: the good request still moves.
    pw.fill(2, [1])
    dw.client.pull("ok", params, [[5]])
    f = dw.client.wait_finished(recving={"ok"}, timeout=20)
    assert f.details[("recving", "ok")].outcome == "done" and dw.mismatch(2, [5], 16) is None


def test_an_abort_that_comes_before_the_publish_releases_it_at_once(daemons):
    p, d = daemons.start("prefill"), daemons.start("decode")
    pw, dw = make_worker(p.grpc, "prefill"), make_worker(d.grpc, "decode")
    cap = secrets.token_bytes(32)
    # D gives the request up before P's worker published it (vLLM hands D the params first).
    assert dw.client.abort("d-req", release=scheduler_params(p.grpc, "prefill", "p-req", cap, [1, 2], 32))
    time.sleep(0.3)
    # Released when published, aborted: within the wait's 10 s, not at the lease's end (60 s), when it would expire.
    pw.client.publish("p-req", [[1, 2]], 32, capability=cap, lease_seconds=60)
    f = pw.client.wait_finished(sending={"p-req"}, timeout=10)
    assert f.details[("sending", "p-req")].outcome == "aborted"
    # Negative control: another capability (another request's publication) is held.
    pw.client.publish("p-req", [[3]], 16, capability=secrets.token_bytes(32), lease_seconds=60)
    time.sleep(1.0)
    assert "p-req" not in pw.client.get_finished().finished_sending


def test_a_pull_that_needs_none_of_a_publication_is_done_and_lets_it_go(daemons):
    """Decode already has every token (its first token is the request's end):
    nothing is planned, nothing read. It was failed as internal (asyncio.wait
    of no reads); now it is done, and P, which no read will acknowledge, is
    told to let the blocks go (not held to the lease's end, 60 s)."""
    p, d = daemons.start("prefill"), daemons.start("decode")
    pw, dw = make_worker(p.grpc, "prefill"), make_worker(d.grpc, "decode")
    pw.fill(3, [1, 2, 3])
    params = pw.client.publish("none-needed", [[1, 2, 3]], 48, lease_seconds=60)
    dw.client.pull("none-needed", params, [[]], first_tokens=[48])
    done = dw.client.wait_finished(recving={"none-needed"}, timeout=30).details[("recving", "none-needed")]
    assert (done.outcome, done.bytes) == ("done", 0), done
    sent = pw.client.wait_finished(sending={"none-needed"}, timeout=10).details[("sending", "none-needed")]
    assert "needed none of it" in sent.reason, sent
    # The daemons serve on: the next pull of the same blocks lands them.
    params = pw.client.publish("then", [[1, 2, 3]], 48)
    dw.client.pull("then", params, [[4, 5, 6]])
    assert dw.client.wait_finished(recving={"then"}, timeout=30).details[("recving", "then")].outcome == "done"
    assert dw.mismatch(3, [4, 5, 6], 48) is None


def test_a_rank_nobody_reads_that_publishes_after_the_read_ends_at_once(daemons):
    """Replicated KV: P TP2 over 1 KV head; D TP1 reads only rank 0."""
    p, d = daemons.start("prefill"), daemons.start("decode")
    pw = [make_worker(p.grpc, "prefill", tp_rank=r, tp_size=2, heads=1) for r in range(2)]
    dw = make_worker(d.grpc, "decode", heads=1)
    cap = secrets.token_bytes(32)
    pw[0].fill(3, [1, 2])
    params = pw[0].client.publish("r", [[1, 2]], 32, capability=cap, lease_seconds=60)
    dw.client.pull("r", params, [[5, 6]])
    f = dw.client.wait_finished(recving={"r"}, timeout=20)
    assert f.details[("recving", "r")].outcome == "done" and dw.mismatch(3, [5, 6], 32) is None
    assert "r" in pw[0].client.wait_finished(sending={"r"}, timeout=10).finished_sending
    # Done when published: within the wait's 10 s, not at the lease's end (60 s), when it would expire.
    pw[1].client.publish("r", [[1, 2]], 32, capability=cap, lease_seconds=60)
    f1 = pw[1].client.wait_finished(sending={"r"}, timeout=10)
    assert f1.details[("sending", "r")].outcome == "done"


def test_peer_calls_naming_another_engine_are_refused_and_change_nothing(daemons):
    """A decode that pulls with the wrong ``remote_engine_id`` at P's address
    fails, and its release (a peer Abort naming that engine) must not end
    P's real publication: the correct pull that follows lands. Abort, renew
    and resolve naming another engine are FAILED_PRECONDITION, naming both."""
    p, d = daemons.start("prefill"), daemons.start("decode")
    pw, dw = make_worker(p.grpc, "prefill"), make_worker(d.grpc, "decode")
    pw.fill(3, [1, 2])
    params = pw.client.publish("r", [[1, 2]], 32, lease_seconds=60)
    wrong = pb.TransferParams()
    wrong.CopyFrom(params)
    wrong.remote_engine_id = "no-such-engine"
    dw.client.pull("r", wrong, [[5, 6]])
    f = dw.client.wait_finished(recving={"r"}, timeout=20)
    assert f.details[("recving", "r")].outcome == "failed" and "no-such-engine" in f.details[("recving", "r")].reason
    stub = pbg.PeerStub(grpc.insecure_channel(p.grpc))
    lease = pb.LeaseRef(request_id="r", generation=params.generation, capability=params.capability)
    calls = {
        "abort": lambda: stub.Abort(pb.PeerAbortRequest(engine_id="no-such-engine", request_id="r", generation=params.generation,
                                                        capability=params.capability, reason="test"), timeout=10),
        "renew": lambda: stub.RenewLeases(pb.RenewLeasesRequest(engine_id="no-such-engine", reader_engine_id="decode", leases=[lease]), timeout=10),
        "resolve": lambda: stub.Resolve(pb.ResolveRequest(engine_id="no-such-engine", request_id="r", capability=params.capability), timeout=10),
    }
    for name, call in calls.items():
        with pytest.raises(grpc.RpcError) as rpc:
            call()
        assert rpc.value.code() == grpc.StatusCode.FAILED_PRECONDITION, (name, rpc.value.details())
        assert "'no-such-engine'" in rpc.value.details() and "'prefill'" in rpc.value.details(), (name, rpc.value.details())
    time.sleep(0.5)  # the failed pull's release has had time to arrive
    assert "r" not in pw.client.get_finished().finished_sending  # P still holds it
    # Negative control: the same calls naming P's engine do reach the publication (renew keeps it alive).
    assert list(stub.RenewLeases(pb.RenewLeasesRequest(engine_id="prefill", reader_engine_id="decode", leases=[lease]), timeout=10).alive) == [True]
    dw.client.pull("r2", params, [[5, 6]])
    f = dw.client.wait_finished(recving={"r2"}, timeout=20)
    assert f.details[("recving", "r2")].outcome == "done" and dw.mismatch(3, [5, 6], 32) is None


@pytest.mark.parametrize("size", [{"tp_size": 1 << 31}, {"pp_size": 1 << 31}], ids=["tp", "pp"])
def test_an_engine_too_wide_is_refused_by_name_and_both_daemons_keep_serving(daemons, size):
    """TP 2^31 is a valid split of a one-head model: before the bound, a worker
    registering it, or a peer handshaking with it, held a daemon's event loop
    walking its ranks (P stopped answering, even SIGTERM)."""
    from tests.rawpeer import fake_engine, handshake

    p, d = daemons.start("prefill"), daemons.start("decode")
    pw = make_worker(p.grpc, "prefill", heads=1)  # registered: a handshake reaches the pairing
    field, value = next(iter(size.items()))
    engine = fake_engine(heads=1)
    setattr(engine, field, value)
    with pytest.raises(grpc.RpcError) as refused:
        handshake(p.grpc, engine)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"engine.{field}={value}" in refused.value.details()
    twice = fake_engine(heads=1)
    twice.ranks.add().CopyFrom(twice.ranks[0])  # each (tp, pp) is looked up once: a list repeating them is no engine
    with pytest.raises(grpc.RpcError) as refused:
        handshake(p.grpc, twice)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "listed twice" in refused.value.details()
    wide = make_worker(d.grpc, "decode", heads=1, register=False)
    wide.client._wid = pb.WorkerId(engine_id="decode", **{"tp_size": 1, "pp_size": 1, **size})
    with pytest.raises(InvalidArgument) as e:
        wide.register()
    assert f"worker.{field}={value} must be in [1, " in e.value.message

    dw = make_worker(d.grpc, "decode", heads=1)
    ids = [1, 2, 3]
    pw.fill(7, ids)
    dw.client.pull("r", pw.client.publish("r", [ids], 48), [ids])
    f = dw.client.wait_finished(recving={"r"}, timeout=15)
    assert f.details[("recving", "r")].outcome == "done" and dw.mismatch(7, ids, 48) is None


def test_a_lease_that_is_not_a_duration_is_refused_by_name(daemons):
    """Before, a publish's NaN or negative lease quietly became the default
    and inf held the blocks for good (``kvd status``: "expires in infs");
    a pull's params with an infinite lease made its renewals never come."""
    p, d = daemons.start("prefill"), daemons.start("decode")
    pw, dw = make_worker(p.grpc, "prefill"), make_worker(d.grpc, "decode")
    for bad in (float("nan"), -1.0, float("inf"), 86400.5):
        with pytest.raises(InvalidArgument) as e:
            pw.client.publish(f"bad-{bad}", [[1]], 16, lease_seconds=bad)
        assert f"lease_seconds={bad!r}" in e.value.message and "must be in [0, 86400]" in e.value.message
    assert pw.client.publish("default", [[1]], 16).lease_seconds == 120.0  # 0: the daemon's default
    assert pw.client.publish("a-day", [[2]], 16, lease_seconds=86400.0).lease_seconds == 86400.0
    pw.fill(5, [3])
    params = pw.client.publish("r", [[3]], 16)
    forever = pb.TransferParams()
    forever.CopyFrom(params)
    forever.lease_seconds = float("inf")
    with pytest.raises(InvalidArgument, match=r"params.lease_seconds=inf must be in \[0, 86400\]"):
        dw.client.pull("r", forever, [[4]])
    dw.client.pull("r", params, [[4]])  # the same pull with P's own lease
    f = dw.client.wait_finished(recving={"r"}, timeout=15)
    assert f.details[("recving", "r")].outcome == "done" and dw.mismatch(5, [4], 16) is None


def test_a_worker_token_that_is_not_hex_is_refused_by_name_on_every_call(daemons):
    """The ``kvd-worker-token`` header carries the token Register answered,
    hex-encoded. Anything else was a ValueError: INTERNAL on unary calls,
    UNKNOWN on the finished-set streams, with a traceback in the log."""
    p = daemons.start("prefill")
    pw = make_worker(p.grpc, "prefill")
    worker = pb.WorkerId(engine_id="prefill", tp_size=1, pp_size=1)
    with grpc.insecure_channel(p.grpc) as ch:
        stub = pbg.WorkerStub(ch)
        calls = {
            "Publish": lambda md: stub.Publish(pb.PublishRequest(worker=worker, request_id="x", block_ids=[pb.BlockIds(ids=[1])], num_tokens=16),
                                               metadata=md, timeout=10),
            "GetEngineFinished": lambda md: stub.GetEngineFinished(pb.EngineFinishedRequest(engine_id="prefill"), metadata=md, timeout=10),
            "WatchFinished": lambda md: next(stub.WatchFinished(pb.GetFinishedRequest(worker=worker), metadata=md, timeout=10)),
            "WatchEngineFinished": lambda md: next(stub.WatchEngineFinished(pb.EngineFinishedRequest(engine_id="prefill"), metadata=md, timeout=10)),
        }
        for name, call in calls.items():
            for bad in ("zz", "0", "ab" * 31 + "g"):
                with pytest.raises(grpc.RpcError) as e:
                    call((("kvd-worker-token", bad),))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, bad, e.value.code(), e.value.details())
                assert "kvd-worker-token" in e.value.details() and f"<{len(bad)} characters>" in e.value.details(), e.value.details()
                assert bad not in e.value.details().split("=", 1)[1], "the token sent is echoed"
    assert "Traceback" not in p.log()
    # The daemon serves on, and the worker's own token is accepted.
    assert pw.client.publish("after", [[1]], 16).generation > 0


def test_a_finished_report_is_checked_by_name_and_a_bad_one_changes_nothing(daemons):
    """Another rank's daemon reports its outcomes to the engine's aggregator
    (Peer.ReportFinished), which merges them into the engine's finished set,
    the one vLLM's scheduler frees blocks by. A rank outside the engine, a
    request id outside the rule, or a direction or outcome nobody sends was
    merged as it came (the fuzzer saw 'bogus' land in finished_recving)."""
    p = daemons.start("prefill")
    w = make_worker(p.grpc, "prefill", tp_rank=0, tp_size=2)
    assert w.client.set_expected_finished_count(1) == 1  # one rank's report finishes a request: whatever is merged shows
    stub = pbg.PeerStub(grpc.insecure_channel(p.grpc))

    def report(tp_rank: int = 1, **detail: str) -> pb.ReportFinishedResponse:
        fields = {"request_id": "ok", "direction": "sending", "outcome": "done", **detail}
        return stub.ReportFinished(pb.ReportFinishedRequest(engine_id="prefill", worker=pb.WorkerId(engine_id="prefill", tp_rank=tp_rank),
                                                            details=[pb.FinishedDetail(**fields)]), timeout=10)

    bad = [({"tp_rank": 2}, "worker", "tp2/pp0"), ({"tp_rank": 2**32 - 1}, "worker", f"tp{2**32 - 1}/pp0"),
           ({"request_id": ""}, "details[0].request_id", "''"), ({"request_id": "x" * 100_000}, "details[0].request_id", "xxxx"),
           ({"direction": "bogus"}, "details[0].direction", "'bogus'"), ({"outcome": "bogus"}, "details[0].outcome", "'bogus'")]
    for fields, field, value in bad:
        with pytest.raises(grpc.RpcError) as e:
            report(**fields)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (fields, e.value.details())
        assert field in e.value.details() and value in e.value.details(), e.value.details()
    time.sleep(0.2)
    merged = w.client.engine_finished()
    assert not (merged.finished_sending or merged.finished_recving), merged
    # Negative control: a good report of rank 1 is merged.
    report()
    deadline = time.monotonic() + 5
    while "ok" not in (merged := w.client.engine_finished()).finished_sending and time.monotonic() < deadline:
        time.sleep(0.1)
    assert merged.finished_sending == {"ok"} and not merged.finished_recving, merged
    assert "Traceback" not in p.log()


def test_ids_a_peer_or_a_worker_names_are_checked_by_the_one_rule(daemons):
    """Engine ids are 1-128 of [A-Za-z0-9-_.:] wherever they come in (the
    rule's check let any unicode letter through), a handshake names its
    daemon's epoch, and an engine expects no more finished reports than it
    has workers (more, and no request would ever finish)."""
    from tests.rawpeer import fake_engine, handshake

    p = daemons.start("prefill")
    w = make_worker(p.grpc, "prefill")
    cases = {
        "handshake engine_id": (lambda: handshake(p.grpc, fake_engine("é")), "caller.engine_id", "'é'"),
        "handshake spaces": (lambda: handshake(p.grpc, fake_engine("a b")), "caller.engine_id", "'a b'"),
        "handshake epoch": (lambda: handshake(p.grpc, fake_engine("d1", epoch="")), "caller.epoch", "''"),
        "handshake long epoch": (lambda: handshake(p.grpc, fake_engine("d1", epoch="e" * 65)), "caller.epoch", "eeee"),
    }
    for name, (call, field, value) in cases.items():
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, e.value.details())
        assert field in e.value.details() and value in e.value.details(), (name, e.value.details())
    for reader in ("a b/c", "x" * 129, "é"):
        with pytest.raises(InvalidArgument, match="reader_engine_id"):
            w.client.publish("r", [[1]], 16, reader_engine_id=reader)
    with pytest.raises(InvalidArgument, match=r"expected_finished_count=2 exceeds engine 'prefill''s 1 workers"):
        w.client.set_expected_finished_count(2)
    # Negative controls: the same calls within the rules are taken.
    assert handshake(p.grpc, fake_engine("d1", epoch="e1")).data_token
    assert w.client.publish("r", [[1]], 16, reader_engine_id="decode-0.pod:1").generation > 0
    assert w.client.set_expected_finished_count(1) == 1


def test_a_pull_names_its_owner_by_host_and_port_or_is_refused(daemons):
    """``::1`` dialled port 443, and the rest failed only after the dial's
    retries, with gRPC's own text; now refused at Pull, by name."""
    p, d = daemons.start("prefill"), daemons.start("decode")
    pw, dw = make_worker(p.grpc, "prefill"), make_worker(d.grpc, "decode")
    params = pw.client.publish("r", [[1]], 16)
    for address in ["127.0.0.1:notaport", ":", "127.0.0.1:99999", "é:1", "::1", "unix:/tmp/nope", "a b:1"]:
        bad = pb.TransferParams()
        bad.CopyFrom(params)
        bad.remote_address = address
        with pytest.raises(InvalidArgument, match=r"params\.remote_address=") as e:
            dw.client.pull("r", bad, [[2]])
        assert address in str(e.value), str(e.value)
    # Negative control: the owner's own address is taken, and the pull lands.
    dw.client.pull("r", params, [[2]])
    assert dw.client.wait_finished(recving={"r"}, timeout=30).details[("recving", "r")].outcome == "done"
