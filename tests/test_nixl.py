"""The NIXL transport on DRAM: byte-exact like TCP, with kvd's leases and checks on top."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvd.transport.nixl import available
from tests.conftest import REPO, make_worker, scrape, transfer

pytestmark = pytest.mark.skipif(bool(available()), reason=f"NIXL NOT TESTED: {available()}")

PAIRINGS = {
    "tp2_to_tp2": "",
    "tp4-b16-HND_to_tp2-pp2-b64-NHD": "--prefill-tp 4 --prefill-block-size 16 --prefill-layout HND --decode-tp 2 --decode-pp 2 --decode-block-size 64 --decode-layout NHD",
    "opaque_cpu_layout_tp2_to_tp1": "--prefill-layout OPAQUE --decode-layout OPAQUE --prefill-tp 2 --decode-tp 1",
    "replicated_kv_tp4_to_tp8": "--kv-heads 2 --prefill-tp 4 --decode-tp 8 --dtype float16",
}


@pytest.mark.parametrize("flags", list(PAIRINGS.values()), ids=list(PAIRINGS))
def test_pairing_over_nixl_is_byte_exact(flags):
    cmd = [sys.executable, "-m", "kvd", "demo", "--transport", "nixl", "--requests", "16", "--layers", "4", "--num-blocks", "256",
           "--max-tokens", "300", "--concurrency", "6", *flags.split()]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "failures       0" in r.stdout and "verified" in r.stdout
    assert "finished_sending reported by all" in r.stdout


def test_bytes_cross_by_nixl_and_new_registrations_reach_the_reader(daemons):
    p, d = daemons.start("prefill", "--transport", "nixl"), daemons.start("decode", "--transport", "nixl")
    pw0 = make_worker(p.grpc, "prefill", tp_rank=0, tp_size=2)
    dw = make_worker(d.grpc, "decode", tp_rank=0, tp_size=2)
    dw1 = make_worker(d.grpc, "decode", tp_rank=1, tp_size=2)
    # Rank 1 of P registers only after D has loaded P's NIXL metadata (through rank 0's first read).
    _, (f,) = transfer([pw0], [dw], "r0", 3, [1, 2, 3], [4, 5, 6], 40)
    assert f.details[("recving", "r0")].outcome == "done" and dw.mismatch(3, [4, 5, 6], 40) is None
    pw1 = make_worker(p.grpc, "prefill", tp_rank=1, tp_size=2)
    _, finished = transfer([pw0, pw1], [dw, dw1], "r1", 4, [7, 8], [9, 10], 32)
    for w, f in zip([dw, dw1], finished, strict=True):
        assert f.details[("recving", "r1")].outcome == "done", f.details[("recving", "r1")]
        assert w.mismatch(4, [9, 10], 32) is None
    per_block = dw.spec.bytes_per_block_per_layer * 4
    moved = (3 + 2 * 2) * per_block
    assert scrape(d.metrics_url, "kvd_received_bytes_total", transport="nixl") == moved
    assert scrape(p.metrics_url, "kvd_sent_bytes_total", transport="nixl") == moved
    assert scrape(d.metrics_url, "kvd_received_bytes_total", transport="tcp") == 0
    # Leases end on the ACK, as on TCP.
    for w in (pw0, pw1):
        assert "r1" in w.client.wait_finished(sending={"r1"}, timeout=10).finished_sending


def test_a_nixl_reader_of_a_tcp_only_owner_fails_with_a_clear_reason(daemons):
    p, d = daemons.start("prefill"), daemons.start("decode", "--transport", "nixl")
    pw, dw = make_worker(p.grpc, "prefill"), make_worker(d.grpc, "decode")
    _, (f,) = transfer([pw], [dw], "r", 1, [1], [2], 16)
    detail = f.details[("recving", "r")]
    assert detail.outcome == "failed" and "no NIXL agent" in detail.reason
    assert f.invalid_block_ids == {2}


def test_nixl_with_mtls_is_refused_at_startup(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvd", "serve", "--engine-id", "e", "--transport", "nixl", "--auth", "mtls",
                        "--tls-cert-file", str(tmp_path / "c.pem"), "--tls-key-file", str(tmp_path / "k.pem"), "--tls-ca-file", str(tmp_path / "ca.pem")],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode != 0
    assert "transport" in r.stderr


def test_gather_staging_is_capped_and_the_reader_is_told(daemons):
    # 1 MiB of staging per connection. D (TP2) reads half the heads of 300 scattered
    # blocks: NHD pieces of half the heads are not dense, so ~2.3 MiB must be gathered.
    p = daemons.start("prefill", "--transport", "nixl", "--nixl-staging-bytes", str(1 << 20))
    d = daemons.start("decode", "--transport", "nixl")
    pw, dw = make_worker(p.grpc, "prefill", num_blocks=700), make_worker(d.grpc, "decode", num_blocks=700, tp_rank=0, tp_size=2)
    p_ids, d_ids = list(range(1, 600, 2)), list(range(2, 601, 2))
    _, (f,) = transfer([pw], [dw], "big", 1, p_ids, d_ids, len(p_ids) * 16)
    detail = f.details[("recving", "big")]
    assert detail.outcome == "failed" and "over the 1048576-byte cap" in detail.reason
    assert f.invalid_block_ids == set(d_ids)
    # The daemon keeps serving reads within the cap.
    _, (f,) = transfer([pw], [dw], "small", 2, [1, 3], [2, 4], 32)
    assert f.details[("recving", "small")].outcome == "done" and dw.mismatch(2, [2, 4], 32) is None


def test_an_idle_nixl_daemon_does_not_spin_a_core(daemons):
    """NIXL's progress thread waits for UCX events; with no wait (delay 0,
    NIXL's own setting: the control) it spins a core, idle or not."""
    import time

    from kvd.tools.bench_socket import process_cpu_seconds

    waits, spins = daemons.start("waits", "--transport", "nixl"), daemons.start("spins", "--transport", "nixl", "--nixl-progress-delay-us", "0")
    assert waits.info and spins.info  # both serving (the agent exists from start-up)
    before = [process_cpu_seconds(d.proc.pid) for d in (waits, spins)]
    time.sleep(3)
    idle, spinning = (process_cpu_seconds(d.proc.pid) - b for d, b in zip((waits, spins), before, strict=True))
    assert idle < 0.3 and spinning > max(0.5, 4 * idle), (idle, spinning)
