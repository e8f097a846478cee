"""Heterogeneous pairings through real daemons and worker processes, byte-exact."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from kvd.client import daemon_status
from tests.conftest import REPO, make_worker, scrape, wait_for
from tests.vllm_support import LEASE_SECONDS

PAIRINGS = {
    "tp4-pp1-b16-HND_to_tp2-pp2-b64-NHD": "--prefill-tp 4 --prefill-pp 1 --prefill-block-size 16 --prefill-layout HND --decode-tp 2 --decode-pp 2 --decode-block-size 64 --decode-layout NHD",
    "tp1-b128-NHD_to_tp4-b32-HND": "--prefill-tp 1 --prefill-block-size 128 --prefill-layout NHD --decode-tp 4 --decode-block-size 32 --decode-layout HND",
    "mla_tp2_to_tp4": "--mla --kv-heads 1 --head-size 576 --prefill-tp 2 --decode-tp 4 --dtype float8_e4m3fn",
    "replicated_kv_2heads_tp4_to_tp8": "--kv-heads 2 --prefill-tp 4 --decode-tp 8 --dtype float16",
    "flashinfer_split_kv": "--prefill-layout HND_BLOCKS_FIRST --decode-layout NHD_SPLIT --prefill-tp 2 --decode-tp 1 --dtype float32",
    "opaque_cpu_layout_tp2_to_tp1": "--prefill-layout OPAQUE --decode-layout OPAQUE --prefill-tp 2 --decode-tp 1",
    # vLLM's CPU attention (K transposed beside V in each span) as data: re-blocked both ways, head-gathered, and to other layouts
    "vllm_cpu_tp2_b128_to_tp1_b64": "--prefill-layout CPU --decode-layout CPU --prefill-tp 2 --decode-tp 1 --prefill-block-size 128 --decode-block-size 64 --dtype float32",
    "vllm_cpu_tp1_b64_to_tp2_b128": "--prefill-layout CPU --decode-layout CPU --prefill-tp 1 --decode-tp 2 --prefill-block-size 64 --decode-block-size 128",
    "nhd_b16_to_vllm_cpu_b32_samehost": "--prefill-layout NHD --decode-layout CPU --prefill-block-size 16 --decode-block-size 32 --transport samehost",
    # A hybrid (a 64-token window on every other layer): each group moves what decode needs of it
    "sliding_window_tp2_pp2_b32_cpu_to_tp1_b16": "--sliding-window 64 --prefill-tp 2 --prefill-pp 2 --decode-tp 1 --prefill-block-size 32 --decode-block-size 16 --prefill-layout CPU --decode-layout CPU",
    "sliding_window_samehost_tp1_to_tp2": "--sliding-window 96 --full-every 4 --prefill-tp 1 --decode-tp 2 --transport samehost",
    "sliding_window_replicated_kv_tp2_to_tp4": "--sliding-window 64 --kv-heads 2 --prefill-tp 2 --decode-tp 4",
    # Mamba2 hybrids: each conv sub-projection and the SSM state split by its own heads, conv layouts differing
    "mamba2_hybrid_tp2_pp2_to_tp1_b16_to_b32_ds_to_sd": "--layers 6 --mamba-every 3 --kv-heads 2 --prefill-tp 2 --prefill-pp 2 --decode-tp 1 --prefill-block-size 16 --decode-block-size 32 --conv-layouts DS,SD",
    "mamba2_sliding_cpu_samehost_tp2_to_tp4": "--layers 6 --mamba-every 3 --sliding-window 64 --kv-heads 4 --prefill-tp 2 --decode-tp 4 --prefill-block-size 32 --decode-block-size 16 --prefill-layout CPU --decode-layout CPU --transport samehost",
    "pure_mamba2_tp1_to_tp2_sd_to_ds": "--mamba-every 1 --kv-heads 2 --prefill-tp 1 --decode-tp 2 --conv-layouts SD,DS",
    # Layer-wise streaming: prefill publishes first and saves a layer every 5 ms while decode reads; a hybrid across TP, PP and block size
    "stream_mamba2_sliding_tp2_pp2_b32_to_tp1_b16": "--stream --layer-ms 5 --layers 6 --mamba-every 3 --sliding-window 64 --kv-heads 2 --prefill-tp 2 --prefill-pp 2 --decode-tp 1 --prefill-block-size 32 --decode-block-size 16 --conv-layouts DS,SD",
    "stream_vllm_cpu_tp1_b64_to_tp2_b128": "--stream --layer-ms 5 --prefill-layout CPU --decode-layout CPU --prefill-tp 1 --decode-tp 2 --prefill-block-size 64 --decode-block-size 128",
}


@pytest.mark.parametrize("flags", list(PAIRINGS.values()), ids=list(PAIRINGS))
def test_pairing_through_daemons_is_byte_exact(flags):
    cmd = [sys.executable, "-m", "kvd", "demo", "--requests", "12", "--layers", "4", "--num-blocks", "256", "--max-tokens", "300", "--concurrency", "6", *flags.split()]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "verified" in r.stdout
    assert "finished_sending reported by all" in r.stdout


def test_a_tp_that_cannot_split_the_heads_is_refused_at_registration(daemons):
    from kvd.core.errors import InvalidArgument

    d = daemons.start("decode")
    with pytest.raises(InvalidArgument, match=r"worker.tp_size=3 .*total_num_kv_heads=4"):
        make_worker(d.grpc, "decode", tp_rank=0, tp_size=3, heads=4, local_heads=1)
    with pytest.raises(InvalidArgument, match=r"num_kv_heads=4 should be 2"):
        make_worker(d.grpc, "decode", tp_rank=0, tp_size=2, heads=4, local_heads=4)


@pytest.mark.parametrize(
    "p_kwargs, d_kwargs, field",
    [
        (dict(block_size=16), dict(block_size=24), "block_size"),
        (dict(dtype="bfloat16"), dict(dtype="float16"), "dtype"),
        (dict(head_size=16), dict(head_size=8), "head_size"),
    ],
)
def test_impossible_pairings_are_refused_before_any_transfer(daemons, p_kwargs, d_kwargs, field):
    p, d = daemons.start("prefill"), daemons.start("decode")
    pw = make_worker(p.grpc, "prefill", **p_kwargs)
    dw = make_worker(d.grpc, "decode", **d_kwargs)
    params = pw.client.publish("r", [[1, 2]], 32)
    assert {x.request_id for x in daemon_status(p.grpc).leases} == {"r"}  # held under its lease until then
    dw.client.pull("r", params, [[3, 4, 5]])
    f = dw.client.wait_finished(recving={"r"}, timeout=30)
    detail = f.details[("recving", "r")]
    assert detail.outcome == "failed"
    assert field in detail.reason and "local=" in detail.reason and "remote=" in detail.reason
    # Refused before any byte landed: every local block is reported invalid.
    assert f.invalid_block_ids == {3, 4, 5}
    # D told P: P frees the blocks now, not at its lease's end, and says why
    # (its log line comes just after the lease is gone, so both are waited for).
    # The bound only separates the two; the path's speed is a benchmark's.
    released = "reader released request_id=r ranks=1: reader decode failed to load it"
    wait_for(lambda: not daemon_status(p.grpc).leases and released in p.log(), LEASE_SECONDS / 12,
             f"P did not say it released the request within {LEASE_SECONDS / 12:.0f} s of D's failed load")
    assert pw.client.wait_finished(sending={"r"}, timeout=5).finished_sending == {"r"}
    assert scrape(p.metrics_url, "kvd_reader_releases_total") == 1


def test_replicas_that_pull_first_do_not_keep_their_source_from_a_slot(daemons):
    """D at TP2 over one KV head: rank 1 holds rank 0's head and copies it
    from rank 0 once rank 0's pull lands. A replica took a pull slot and
    then waited in it for its source: with every slot so taken (one here,
    64 by default, by a burst of replicas whose Pulls came first) the
    sources queued behind them, nothing moved until the replicas timed out
    (failed, vLLM recomputes), and only then did the sources run. Negative
    control, the slot taken first: the replica failed at the timeout."""
    p = daemons.start("prefill")
    d = daemons.start("decode", "--max-concurrent-pulls", "1", "--pull-timeout-seconds", "10")
    pw = make_worker(p.grpc, "prefill", heads=1)
    d0 = make_worker(d.grpc, "decode", tp_rank=0, tp_size=2, heads=1)
    d1 = make_worker(d.grpc, "decode", tp_rank=1, tp_size=2, heads=1)
    pw.fill(4, [1, 2])
    params = pw.client.publish("r", [[1, 2]], 32)
    t0 = time.monotonic()
    d1.client.pull("r", params, [[5, 6]])  # the replica's Pull first
    time.sleep(0.5)
    d0.client.pull("r", params, [[7, 8]])
    for w, ids in ((d0, [7, 8]), (d1, [5, 6])):
        f = w.client.wait_finished(recving={"r"}, timeout=30)
        assert f.details[("recving", "r")].outcome == "done", f.details[("recving", "r")]
        assert w.mismatch(4, ids, 32) is None
    assert time.monotonic() - t0 < 8, "the pulls waited for a timeout"
