"""End-to-end verification between real daemons (``kvd serve --verify``):
P digests what it publishes, D checks what landed against it, and a load
whose bytes differ fails exactly the blocks that differ."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time

import pytest

from kvd.client import daemon_status
from kvd.testing import pattern
from kvd.testing.metrics import scrape
from tests.conftest import make_worker

NTOK = 150  # P: 5 blocks of 32; D: 10 of 16, across a TP split and a relayout


def start(daemons, p_mode: str = "sampled", d_mode: str = "sampled"):
    p = daemons.start("prefill", "--verify", p_mode)
    d = daemons.start("decode", "--verify", d_mode)
    ps = [make_worker(p.grpc, "prefill", block_size=32, layout="HND")]
    ds = [make_worker(d.grpc, "decode", tp_rank=r, tp_size=2, block_size=16) for r in range(2)]
    return p, d, ps, ds


def publish(ps, rid: str, p_ids: list[int], seed: int = 7):
    cap = secrets.token_bytes(32)
    params = None
    for w in ps:
        w.fill(seed, p_ids)
        params = w.client.publish(rid, [p_ids], NTOK, capability=cap)
    return params


def pull(ds, rid: str, params, d_ids: list[int]):
    for w in ds:
        w.client.pull(rid, params, [d_ids])
    return [w.client.wait_finished(recving={rid}, timeout=30) for w in ds]


P_IDS, D_IDS = [7, 2, 11, 4, 9], [3, 17, 5, 9, 12, 1, 20, 8, 14, 6]


@pytest.mark.parametrize("mode", ["sampled", "full"])
def test_a_verified_load_lands_and_is_counted_ok(daemons, mode):
    p, d, ps, ds = start(daemons, mode, mode)
    params = publish(ps, "r1", P_IDS)
    finished = pull(ds, "r1", params, D_IDS)
    assert all(f.details[("recving", "r1")].outcome == "done" and not f.invalid_block_ids for f in finished), finished
    assert all(w.mismatch(7, D_IDS, NTOK) is None for w in ds)
    assert scrape(d.metrics_url, "kvd_verify_checks_total", result="ok") == 2
    assert scrape(p.metrics_url, "kvd_verify_digests_total") == 1


def test_p_cache_altered_after_publishing_fails_exactly_the_blocks_that_hold_it(daemons):
    """The negative control: P reuses one published block for another
    request's tokens before D reads it. D lands those bytes, and the full
    check fails exactly D's two blocks over that P block, on both D ranks;
    the rest of the load stands."""
    _p, d, ps, ds = start(daemons, "full", "full")
    params = publish(ps, "r2", P_IDS)
    for w in ps:
        pattern.fill(w.tensors, 8, [P_IDS[3]], w.coords, first_token=96)  # P's 4th block: tokens 96..127
    finished = pull(ds, "r2", params, D_IDS)
    for f in finished:
        assert f.details[("recving", "r2")].outcome == "failed"
        assert "differs from what 'prefill' published" in f.details[("recving", "r2")].reason
        assert f.invalid_block_ids == {D_IDS[6], D_IDS[7]}, f
    assert scrape(d.metrics_url, "kvd_verify_checks_total", result="mismatch") == 2
    assert scrape(d.metrics_url, "kvd_verify_mismatches_total") == 4
    assert scrape(d.metrics_url, "kvd_pull_failures_total", reason="verify_mismatch") == 2
    # Without verification the same alteration lands silently: the check is what caught it.
    d2 = daemons.start("decode2", "--verify", "off")
    plain = [make_worker(d2.grpc, "decode2", tp_rank=r, tp_size=2, block_size=16) for r in range(2)]
    params = publish(ps, "r3", P_IDS)
    for w in ps:
        pattern.fill(w.tensors, 8, [P_IDS[3]], w.coords, first_token=96)
    assert all(f.details[("recving", "r3")].outcome == "done" for f in pull(plain, "r3", params, D_IDS))


def test_the_sample_catches_a_request_whose_blocks_p_reused(daemons):
    """Sampled mode (one row of every 16 tokens of each layer) against a
    systematic fault: every block P published is rewritten with another
    request's tokens before D reads them. Both D ranks fail the load, only
    in blocks of it; with nothing rewritten, the same sample passes."""
    _p, d, ps, ds = start(daemons)
    params = publish(ps, "r7", P_IDS)
    for w in ps:
        pattern.fill(w.tensors, 8, P_IDS, w.coords)
    for f in pull(ds, "r7", params, D_IDS):
        assert f.details[("recving", "r7")].outcome == "failed", f
        assert f.invalid_block_ids and f.invalid_block_ids <= set(D_IDS), f
    assert scrape(d.metrics_url, "kvd_verify_checks_total", result="mismatch") == 2
    clean = pull(ds, "r8", publish(ps, "r8", P_IDS), D_IDS)
    assert all(f.details[("recving", "r8")].outcome == "done" for f in clean)
    assert scrape(d.metrics_url, "kvd_verify_checks_total", result="ok") == 2


def test_one_rank_failing_its_check_does_not_cut_off_its_sibling(daemons):
    """Two D ranks on one daemon read the same publication; D runs one pull
    at a time, so rank 1 is still queued when rank 0's check fails. Rank 0's
    failure must not end P's publication under rank 1: D tells P only once
    its last rank reading it has ended. Each rank then fails exactly the two
    blocks over the altered P block, from its own check; a daemon that told
    P at once would leave rank 1 refused, with its whole load invalid."""
    p = daemons.start("prefill", "--verify", "full")
    d = daemons.start("decode", "--verify", "full", "--max-concurrent-pulls", "1")
    ps = [make_worker(p.grpc, "prefill", block_size=32, layout="HND")]
    ds = [make_worker(d.grpc, "decode", tp_rank=r, tp_size=2, block_size=16) for r in range(2)]
    params = publish(ps, "r11", P_IDS)
    for w in ps:
        pattern.fill(w.tensors, 8, [P_IDS[3]], w.coords, first_token=96)
    for f in pull(ds, "r11", params, D_IDS):
        assert f.details[("recving", "r11")].outcome == "failed", f
        assert "differs from what 'prefill' published" in f.details[("recving", "r11")].reason, f
        assert f.invalid_block_ids == {D_IDS[6], D_IDS[7]}, f
    assert scrape(d.metrics_url, "kvd_verify_checks_total", result="mismatch") == 2
    # Both read every byte, so P let the publication go on their acknowledgements.
    deadline = time.monotonic() + 10
    while any(x.request_id == "r11" for x in daemon_status(p.grpc).leases) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(x.request_id == "r11" for x in daemon_status(p.grpc).leases)


def test_a_relayout_that_swaps_two_heads_is_caught_by_the_sample(daemons, monkeypatch):
    """The relayout-bug control, through real daemons: D's daemon, with the
    test-only landing fault, puts local heads 0 and 1 of every block it lands
    in each other's place (every byte arrives; only where it lands is wrong).
    The default sample fails the load on both D ranks, only in blocks of it;
    the same publication's bytes through a daemon without the fault pass, and
    a bad fault name keeps the daemon from starting."""
    p = daemons.start("prefill", "--verify", "sampled")
    monkeypatch.setenv("KVD_TEST_LANDING_FAULT", "swap_heads")
    d = daemons.start("decode", "--verify", "sampled")
    monkeypatch.delenv("KVD_TEST_LANDING_FAULT")
    clean_d = daemons.start("decode2", "--verify", "sampled")
    ps = [make_worker(p.grpc, "prefill", block_size=32, layout="HND")]
    ds = [make_worker(d.grpc, "decode", tp_rank=r, tp_size=2, block_size=16) for r in range(2)]
    clean = [make_worker(clean_d.grpc, "decode2", tp_rank=r, tp_size=2, block_size=16) for r in range(2)]
    for f in pull(clean, "r9", publish(ps, "r9", P_IDS), D_IDS):  # the control first: the fault is D's alone
        assert f.details[("recving", "r9")].outcome == "done" and not f.invalid_block_ids, f
    assert all(w.mismatch(7, D_IDS, NTOK) is None for w in clean)
    for f in pull(ds, "r10", publish(ps, "r10", P_IDS), D_IDS):
        assert f.details[("recving", "r10")].outcome == "failed", f
        assert f.invalid_block_ids and f.invalid_block_ids <= set(D_IDS), f
    assert scrape(d.metrics_url, "kvd_verify_checks_total", result="mismatch") == 2
    assert "KVD_TEST_LANDING_FAULT=swap_heads" in d.log() and "KVD_TEST_LANDING_FAULT" not in clean_d.log()
    assert any(w.mismatch(7, D_IDS, NTOK) is not None for w in ds)  # the fault did alter what landed
    env = {**os.environ, "KVD_TEST_LANDING_FAULT": "swap_tokens"}
    r = subprocess.run([sys.executable, "-m", "kvd", "serve", "--engine-id", "x"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode != 0 and "KVD_TEST_LANDING_FAULT" in r.stderr and "swap_tokens" in r.stderr, r.stderr[-2000:]


def test_an_owner_that_does_not_verify_leaves_the_load_unverified_not_failed(daemons):
    _p, d, ps, ds = start(daemons, p_mode="off")
    finished = pull(ds, "r4", publish(ps, "r4", P_IDS), D_IDS)
    assert all(f.details[("recving", "r4")].outcome == "done" for f in finished)
    assert scrape(d.metrics_url, "kvd_verify_checks_total", result="unverified") == 2
    assert "gave no digest: NOT_FOUND" in d.log()


def test_an_unknown_mode_is_refused_naming_the_key():
    r = subprocess.run([sys.executable, "-m", "kvd", "serve", "--engine-id", "x", "--verify", "sometimes"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "verify" in r.stderr and "sometimes" in r.stderr and "off, sampled or full" in r.stderr, r.stderr


def test_a_byte_flipped_in_transit_fails_exactly_the_block_it_landed_in(daemons):
    """TCP's own checksum passes what a faulty NIC, switch or proxy changed:
    a proxy flips one bit of P's data stream, D lands it, and the full check
    fails exactly the one block that differs from P's pattern."""
    from tests.faultproxy import prefill_behind_proxy

    p, proxy = prefill_behind_proxy(daemons, "--verify", "full")
    d = daemons.start("decode", "--verify", "full")
    big = dict(layers=4, heads=4, head_size=64, num_blocks=256)  # 16 KiB a block a layer
    pw, dw = make_worker(p.grpc, "prefill", **big), make_worker(d.grpc, "decode", **big)
    ids, ntok = list(range(1, 101)), 100 * 16
    pw.fill(5, ids)
    params = pw.client.publish("r5", [ids], ntok)
    proxy.flip_at = 3_000_000  # well inside the 6.4 MB of KV, past any header
    dw.client.pull("r5", params, [ids])
    f = dw.client.wait_finished(recving={"r5"}, timeout=30)
    proxy.close()
    assert proxy.flip_at is None, "the proxy flipped its bit"
    wrong = {b for i, b in enumerate(ids) if pattern.mismatch(dw.tensors, 5, [b], dw.coords, ntok, first_token=16 * i) is not None}
    assert len(wrong) == 1, wrong  # the flip landed in one block: the control that the check is not vacuous
    assert f.details[("recving", "r5")].outcome == "failed" and f.invalid_block_ids == wrong, f
    assert scrape(d.metrics_url, "kvd_verify_mismatches_total") == 1


def test_the_demo_verifies_end_to_end():
    """Attention and Mamba2 state parts, TP1 to TP2, block size 16 to 32."""
    r = subprocess.run([sys.executable, "-m", "kvd", "demo", "--requests", "24", "--layers", "2", "--num-blocks", "512", "--max-tokens", "256",
                        "--verify", "full", "--prefill-tp", "1", "--decode-block-size", "32", "--mamba-every", "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "decode's daemon checked 48 reads clean against prefill's digests, 0 mismatched, 0 unverified" in r.stdout, r.stdout[-2000:]


def test_a_digest_question_out_of_bounds_is_refused_by_name_and_the_daemon_serves_on(daemons):
    """A reader asking for 2^32 one-token bins would have the owner allocate
    terabytes: refused, naming the field; the next good question is answered."""
    import grpc

    from kvd.proto import kvd_pb2 as pb
    from kvd.proto import kvd_pb2_grpc as pbg

    p, _d, ps, ds = start(daemons)
    params = publish(ps, "r6", P_IDS)
    with grpc.insecure_channel(p.grpc) as ch:
        stub = pbg.PeerStub(ch)

        def ask(**rows):
            req = pb.DigestRequest(engine_id="prefill", request_id="r6", generation=params.generation, capability=params.capability,
                                   rows=[pb.DigestRows(**{"group_id": 0, "layers": [0, 1], "head_start": 0, "head_stop": 4,
                                                          "token_start": 0, "token_stop": NTOK, "bin_tokens": 16, **rows})])
            return stub.Digest(req, timeout=10)

        with pytest.raises(grpc.RpcError) as e:
            ask(token_stop=2**32 - 1, bin_tokens=1)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "rows[0].token_stop" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            ask(layers=[0, 0])
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "rows[0].layers" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            ask(bin_tokens=0)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "rows.bin_tokens" in e.value.details()
        assert len(ask().groups[0].sums) == 2 * 10  # 2 layers x 10 bins of 16
    finished = pull(ds, "r6", params, D_IDS)  # and the reader's own check still passes
    assert all(f.details[("recving", "r6")].outcome == "done" for f in finished)


def test_a_request_asks_to_be_checked_whole_and_a_bad_mode_is_refused_by_name(daemons):
    """Both daemons sample; one request is published with verify=full: a
    single byte P changed after publishing (which a sample of 2 rows a
    window would most likely miss) fails exactly its block, the owner's
    answer saying every row was checked. A mode of another name is refused
    before anything is published."""
    _p, d, ps, ds = start(daemons)
    cap = secrets.token_bytes(32)
    for w in ps:
        w.fill(7, P_IDS)
    params = ps[0].client.publish("r9", [P_IDS], NTOK, capability=cap, verify="full")
    view = ps[0].tensors.parts[0]
    layer0 = view[0] if not isinstance(view, list) else view[0][0]
    layer0[1, P_IDS[2], 20, 3, 5] ^= 1  # V, P's 3rd block (tokens 64..95), its 21st token: D's 5th block; head 3
    finished = pull(ds, "r9", params, D_IDS)
    bad = [f for f in finished if f.details[("recving", "r9")].outcome == "failed"]
    assert len(bad) == 1 and bad[0].invalid_block_ids == {D_IDS[5]}, finished  # head 3 is D rank 1's
    assert "every row" in bad[0].details[("recving", "r9")].reason
    with pytest.raises(Exception, match=r"verify='always'"):
        ps[0].client.publish("r10", [P_IDS], NTOK, capability=cap, verify="always")
    assert scrape(d.metrics_url, "kvd_verify_checks_total", result="ok") == 1


def test_a_fraction_of_sampled_requests_is_checked_whole(daemons):
    """--verify-full-fraction 1 on the owner: every request it publishes is
    digested whole, so one changed byte fails exactly its block; a fraction
    out of [0, 1] is refused at startup, naming the key."""
    p = daemons.start("prefill", "--verify", "sampled", "--verify-full-fraction", "1")
    d = daemons.start("decode", "--verify", "sampled")
    pw = make_worker(p.grpc, "prefill", block_size=32, layout="HND")
    dw = make_worker(d.grpc, "decode", block_size=16)
    pw.fill(7, P_IDS)
    params = pw.client.publish("r11", [P_IDS], NTOK)
    view = pw.tensors.parts[0]
    (view[0] if not isinstance(view, list) else view[0][0])[0, P_IDS[1], 5, 0, 2] ^= 1  # K, P's 2nd block, token 37: D's 3rd block
    f = pull([dw], "r11", params, D_IDS)[0]
    assert f.details[("recving", "r11")].outcome == "failed" and f.invalid_block_ids == {D_IDS[2]}, f
    assert "every row" in f.details[("recving", "r11")].reason
    r = subprocess.run([sys.executable, "-m", "kvd", "serve", "--engine-id", "x", "--verify-full-fraction", "1.5"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "verify_full_fraction" in r.stderr and "1.5" in r.stderr, r.stderr


def test_params_made_before_p_published_are_verified_once_resolved(daemons):
    """vLLM's scheduler hands D params before P's workers publish (no
    generation yet): D's question waits for the resolved publication, so
    the load is checked, not left unverified; a P block changed after
    publishing is still caught."""
    from tests.conftest import scheduler_params

    p, d, ps, ds = start(daemons)
    cap = secrets.token_bytes(32)
    params = scheduler_params(p.grpc, "prefill", "r12", cap, P_IDS, NTOK)
    params.remote_tp_size = 1
    for w in ds:
        w.client.pull("r12", params, [D_IDS])
    for w in ps:
        w.fill(7, P_IDS)
        w.client.publish("r12", [P_IDS], NTOK, capability=cap)
    finished = [w.client.wait_finished(recving={"r12"}, timeout=30) for w in ds]
    assert all(f.details[("recving", "r12")].outcome == "done" for f in finished), finished
    assert scrape(d.metrics_url, "kvd_verify_checks_total", result="ok") == 2
    assert scrape(d.metrics_url, "kvd_verify_checks_total", result="unverified") == 0


def test_nothing_is_digested_for_a_caller_that_may_not_publish(daemons):
    """--verify full: a Publish for a worker with a token that is not its
    own, and an engine-wide one with no worker's token, are refused before
    the daemon digests the blocks they name (any local process could
    otherwise make it read and hash a worker's cache, over and over). The
    control: the worker's own publish is digested."""
    import grpc

    from kvd.proto import kvd_pb2 as pb
    from kvd.proto import kvd_pb2_grpc as pbg

    p = daemons.start("prefill", "--verify", "full")
    pw = make_worker(p.grpc, "prefill", num_blocks=64)
    pw.fill(3, list(range(1, 33)))
    before = scrape(p.metrics_url, "kvd_verify_digest_seconds_count")
    worker = pb.WorkerId(engine_id="prefill", tp_size=1, pp_size=1)
    blocks = [pb.BlockIds(ids=list(range(1, 33)))]
    with grpc.insecure_channel(p.grpc) as ch:
        stub = pbg.WorkerStub(ch)
        for call in (lambda md: stub.Publish(pb.PublishRequest(worker=worker, request_id="x", block_ids=blocks, num_tokens=512), metadata=md, timeout=10),
                     lambda md: stub.PublishEngine(pb.PublishEngineRequest(engine_id="prefill", request_id="y", block_ids=blocks, num_tokens=512),
                                                   metadata=md, timeout=10)):
            with pytest.raises(grpc.RpcError) as e:
                call((("kvd-worker-token", secrets.token_hex(32)),))
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, e.value.details()
    assert scrape(p.metrics_url, "kvd_verify_digest_seconds_count") == before
    pw.client.publish("mine", [list(range(1, 33))], 512)
    assert scrape(p.metrics_url, "kvd_verify_digest_seconds_count") == before + 1
