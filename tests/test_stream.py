"""Layer-wise streaming with real daemons: prefill publishes before it
computes, decode's pull starts at once, and each layer crosses as soon as
prefill saves it; nothing is served before its layer is saved, and a
prefill that dies or stops mid-stream gives exactly the blocks that did not
land."""

from __future__ import annotations

import signal
import time

import pytest

from kvd.caches import local_group_tensors
from kvd.errors import KvdError
from kvd.testing import pattern
from tests.conftest import make_worker, scrape

SHAPE = dict(layers=8, heads=4, head_size=64, num_blocks=256)
IDS = list(range(1, 129))
NTOK = len(IDS) * 16


def layer_mismatch(w, layer: int, seed: int, ids, ntok: int):
    """The first difference in one layer of a test worker's blocks."""
    name = f"model.layers.{layer}.self_attn.attn"
    return pattern.mismatch(local_group_tensors(w.spec, {name: w.caches[name]}), seed, ids, w.coords, ntok)


def compute(pw, seed: int, positions) -> None:
    """Prefill 'computes' layers: writes their KV, then says they are saved."""
    for p in positions:
        pattern.fill(pw.tensors, seed, IDS, pw.coords, positions=[p])
        pw.client.layers_saved(["r"], p + 1)


def streaming_pull(daemons, *, p_seed: int | None = None, d_seed: int | None = None):
    """A prefill and a decode daemon with a worker each, and decode's pull of
    ``r``, published streaming with no layer saved yet; each side's blocks
    filled first where a seed is given. Returns P's daemon and both workers."""
    p, d = daemons.start("prefill"), daemons.start("decode")
    pw, dw = make_worker(p.grpc, "prefill", **SHAPE), make_worker(d.grpc, "decode", **SHAPE)
    if p_seed is not None:
        pw.fill(p_seed, IDS)
    if d_seed is not None:
        dw.fill(d_seed, IDS)
    params = pw.client.publish("r", [IDS], NTOK, stream=True)
    assert params.stream
    dw.client.pull("r", params, [IDS])
    return p, pw, dw


def test_each_layer_crosses_once_saved_and_not_before(daemons):
    p, pw, dw = streaming_pull(daemons, p_seed=99, d_seed=5)  # P's: what the blocks held before this prompt, never to be read
    time.sleep(0.5)
    assert dw.client.get_finished().finished_recving == set()
    assert dw.mismatch(5, IDS, NTOK) is None  # nothing landed: no layer is saved

    compute(pw, 7, range(4))
    deadline = time.monotonic() + 10
    while layer_mismatch(dw, 3, 7, IDS, NTOK) is not None:
        assert time.monotonic() < deadline, "saved layers did not cross while later ones were still being computed"
        time.sleep(0.02)
    assert layer_mismatch(dw, 0, 7, IDS, NTOK) is None
    assert layer_mismatch(dw, 4, 5, IDS, NTOK) is None  # layer 4 not saved: decode's blocks untouched
    assert dw.client.get_finished().finished_recving == set()

    compute(pw, 7, range(4, 8))
    f = dw.client.wait_finished(recving={"r"}, timeout=30)
    assert f.details[("recving", "r")].outcome == "done" and not f.invalid_block_ids
    assert dw.mismatch(7, IDS, NTOK) is None
    assert pw.client.wait_finished(sending={"r"}, timeout=10).details[("sending", "r")].outcome == "done"
    assert scrape(p.metrics_url, "kvd_stream_layers_saved_total") == 8
    assert scrape(p.metrics_url, "kvd_stream_layer_save_reports_total") == 8


def test_a_layer_reported_saved_but_not_written_is_caught(daemons):
    """The negative control: the check above would see prefill's old bytes."""
    _, pw, dw = streaming_pull(daemons, p_seed=99)
    compute(pw, 7, range(7))
    pw.client.layers_saved(["r"], 8)  # layer 7 never written
    assert dw.client.wait_finished(recving={"r"}, timeout=30).details[("recving", "r")].outcome == "done"
    assert layer_mismatch(dw, 6, 7, IDS, NTOK) is None
    bad = dw.mismatch(7, IDS, NTOK)
    assert bad is not None and bad.startswith("layer 7")


def test_saves_arriving_out_of_order_count_each_layer_once(daemons):
    """A worker's LayersSaved calls are sent without waiting, so a later one
    may reach the daemon first (a real-engine run counted 3 of 4 layers
    when the count was of calls that moved a watermark). Each layer a
    request's rank saved is counted once, before any read it wakes lands."""
    p, pw, dw = streaming_pull(daemons)
    pattern.fill(pw.tensors, 7, IDS, pw.coords)
    pw.client.layers_saved(["r"], 5, wait=True)
    pw.client.layers_saved(["r"], 2, wait=True)  # late: layers 0 and 1 were said saved already
    assert scrape(p.metrics_url, "kvd_stream_layers_saved_total") == 5
    pw.client.layers_saved(["r"], 8, wait=True)
    pw.client.layers_saved(["other", "r"], 8, wait=True)  # not published here, and r's repeated: nothing counted
    f = dw.client.wait_finished(recving={"r"}, timeout=30)
    assert f.details[("recving", "r")].outcome == "done" and dw.mismatch(7, IDS, NTOK) is None
    assert scrape(p.metrics_url, "kvd_stream_layers_saved_total") == 8
    assert scrape(p.metrics_url, "kvd_stream_layer_save_reports_total") == 5  # r in each of the four calls, and other


@pytest.mark.faults
def test_prefill_that_stops_saving_fails_the_pull_with_every_block_invalid(daemons):
    p = daemons.start("prefill", "--layer-wait-seconds", "1.5")
    d = daemons.start("decode", "--layer-wait-seconds", "1.5")
    pw, dw = make_worker(p.grpc, "prefill", **SHAPE), make_worker(d.grpc, "decode", **SHAPE)
    params = pw.client.publish("r", [IDS], NTOK, stream=True)
    dw.client.pull("r", params, [IDS])
    compute(pw, 7, range(3))  # then the worker hangs (or died: the daemon cannot tell)
    t0 = time.monotonic()
    f = dw.client.wait_finished(recving={"r"}, timeout=30)
    detail = f.details[("recving", "r")]
    assert detail.outcome == "failed" and "layer_wait_seconds" in detail.reason, detail
    assert f.invalid_block_ids == set(IDS)  # each block lacks layers 3..7
    assert time.monotonic() - t0 < 10
    # P is told, and frees the blocks at once rather than at its lease.
    assert pw.client.wait_finished(sending={"r"}, timeout=10).details[("sending", "r")].outcome == "aborted"


@pytest.mark.faults
def test_prefill_daemon_killed_mid_stream_gives_exact_invalid_blocks(daemons):
    p, d = daemons.start("prefill"), daemons.start("decode", "--stall-timeout-seconds", "3")
    pw, dw = make_worker(p.grpc, "prefill", **SHAPE), make_worker(d.grpc, "decode", **SHAPE)
    # Two requests: one streams to the end, one is cut off by the kill.
    other = list(range(129, 161))
    params_done = pw.client.publish("done", [other], len(other) * 16)
    dw.client.pull("done", params_done, [other])
    assert dw.client.wait_finished(recving={"done"}, timeout=30).details[("recving", "done")].outcome == "done"
    params = pw.client.publish("r", [IDS], NTOK, stream=True)
    dw.client.pull("r", params, [IDS])
    compute(pw, 7, range(2))
    time.sleep(0.3)
    p.stop(signal.SIGKILL)
    f = dw.client.wait_finished(recving={"r"}, timeout=30)
    assert f.details[("recving", "r")].outcome == "failed"
    assert f.invalid_block_ids == set(IDS)  # exactly this request's blocks, none of the other's


def test_abort_on_prefill_mid_stream_ends_the_read_at_once(daemons):
    _, pw, dw = streaming_pull(daemons)
    compute(pw, 7, range(2))
    time.sleep(0.2)
    t0 = time.monotonic()
    assert pw.client.abort("r")
    f = dw.client.wait_finished(recving={"r"}, timeout=30)
    assert f.details[("recving", "r")].outcome == "failed" and f.invalid_block_ids == set(IDS)
    assert time.monotonic() - t0 < 5  # woken by the abort, not by layer_wait_seconds (30 s)


def test_refused_layers_saved_names_the_request(daemons):
    p = daemons.start("prefill")
    pw = make_worker(p.grpc, "prefill", **SHAPE)
    with pytest.raises(KvdError) as e:
        pw.client.layers_saved(["ok", ""], 1, wait=True)
    assert "request_ids[1]" in e.value.message
    pw.client.layers_saved([""], 1)  # sent without waiting: refused on the next call
    time.sleep(0.5)
    with pytest.raises(KvdError, match="request_ids"):
        pw.client.flush_saves()


def test_layers_saved_past_the_model_is_refused_by_name(daemons):
    _, pw, dw = streaming_pull(daemons, d_seed=5)
    with pytest.raises(KvdError) as e:
        pw.client.layers_saved(["r"], SHAPE["layers"] + 1, wait=True)
    assert e.value.status.name == "INVALID_ARGUMENT" and "layers_saved=9" in e.value.message and "num_layers=8" in e.value.message
    time.sleep(0.3)
    assert dw.mismatch(5, IDS, NTOK) is None  # refused: nothing was said saved, nothing crossed
    compute(pw, 7, range(SHAPE["layers"]))  # every layer, the last saying all 8: accepted
    f = dw.client.wait_finished(recving={"r"}, timeout=30)
    assert f.details[("recving", "r")].outcome == "done" and not f.invalid_block_ids
    assert dw.mismatch(7, IDS, NTOK) is None


def test_pull_dispatched_before_prefill_published_resolves_its_blocks(daemons):
    """As ``kvd proxy --prefill-kvd`` dispatches: D's pull names only P's
    daemon, the request and a capability the proxy picked; P publishes
    later, under that capability, and its blocks reach D through Resolve."""
    import secrets
    import threading

    from kvd.proto import kvd_pb2 as pb

    p, d = daemons.start("prefill"), daemons.start("decode")
    pw, dw = make_worker(p.grpc, "prefill", **SHAPE), make_worker(d.grpc, "decode", **SHAPE)
    cap = secrets.token_bytes(32)
    p_ids, d_ids = IDS, [i + 100 for i in IDS[:100]] + list(range(2, 30))  # D's own, other blocks
    params = pb.TransferParams(remote_engine_id="prefill", remote_address=p.grpc, request_id="r", capability=cap, num_tokens=NTOK - 1,
                               block_ids=[pb.BlockIds()], stream=True)
    pw.fill(99, p_ids)

    def prefill() -> None:
        time.sleep(0.3)
        pw.client.publish("r", [p_ids], NTOK, capability=cap, stream=True)
        compute(pw, 7, range(8))

    t = threading.Thread(target=prefill)
    t.start()
    dw.client.pull("r", params, [d_ids])
    f = dw.client.wait_finished(recving={"r"}, timeout=30)
    t.join()
    assert f.details[("recving", "r")].outcome == "done", f.details
    assert dw.mismatch(7, d_ids, NTOK - 1) is None


def test_a_pull_whose_params_predate_the_publication_streams_if_the_publication_does(daemons):
    """Params made before P published (generation 0, no blocks) that do not
    say ``stream``: Resolve answers it, and D reads layer by layer as P saves
    them, instead of a whole-request read that stalls while P still computes."""
    import secrets
    import threading

    from kvd.proto import kvd_pb2 as pb

    p, d = daemons.start("prefill"), daemons.start("decode", "--stall-timeout-seconds", "2")
    pw, dw = make_worker(p.grpc, "prefill", **SHAPE), make_worker(d.grpc, "decode", **SHAPE)
    cap = secrets.token_bytes(32)
    params = pb.TransferParams(remote_engine_id="prefill", remote_address=p.grpc, request_id="r", capability=cap, num_tokens=NTOK,
                               block_ids=[pb.BlockIds()])
    assert not params.stream
    pw.fill(99, IDS)

    def prefill() -> None:
        time.sleep(0.3)
        pw.client.publish("r", [IDS], NTOK, capability=cap, stream=True)
        for layer in range(8):  # 3.2 s of compute: longer than decode's stall bound
            time.sleep(0.4)
            compute(pw, 7, [layer])

    t = threading.Thread(target=prefill)
    t.start()
    dw.client.pull("r", params, [IDS])
    f = dw.client.wait_finished(recving={"r"}, timeout=30)
    t.join()
    assert f.details[("recving", "r")].outcome == "done", f.details
    assert dw.mismatch(7, IDS, NTOK) is None
