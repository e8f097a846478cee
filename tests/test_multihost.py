"""Faults between two hosts: the prefill and decode daemons in their own
network namespaces, joined by a veth pair (tests/netns.py). Partitions are
the link taken down; a flaky link is the link taken down and up in short
bursts, which gives real TCP retransmissions and stalls. Every request ends
with every byte exact or reported invalid, and nothing is held past its lease.
"""

from __future__ import annotations

import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvd.client import daemon_status
from kvd.proto import kvd_pb2 as pb
from tests.conftest import DaemonProc, Daemons, TestWorker, make_worker
from tests.netns import Hosts, Unavailable, plain_socket_seconds

pytestmark = [pytest.mark.faults, pytest.mark.multihost]

BIG = dict(layers=8, heads=4, head_size=128, num_blocks=1024)  # 32 KiB per block per layer: 256 KiB a block
BLOCK_BYTES = 256 << 10


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    try:
        h = Hosts.create()
    except Unavailable as e:
        pytest.skip(f"MULTI-HOST NOT TESTED: {e}")
    try:
        yield h
    finally:
        h.destroy()


@pytest.fixture
def sockdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kvd-mh-"))  # short: Unix socket paths are limited to 108 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


def start_pair(daemons: Daemons, hosts: Hosts, sockdir: Path, p_extra: tuple[str, ...] = (), d_extra: tuple[str, ...] = ()
               ) -> tuple[DaemonProc, DaemonProc, str, str]:
    """A daemon on each host; their worker sockets are the test's way in."""
    p_sock, d_sock = sockdir / "p.sock", sockdir / "d.sock"
    p = daemons.start("prefill", "--host", hosts.prefill.address, "--worker-socket", str(p_sock), *p_extra, prefix=hosts.prefill.exec)
    d = daemons.start("decode", "--host", hosts.decode.address, "--worker-socket", str(d_sock), *d_extra, prefix=hosts.decode.exec)
    # Each ready, as its ready file says (within 60 s, as for every test's daemon); a worker's own
    # wait for the socket (30 s) was the start-up's only bound, too short on a machine busy with engines.
    assert p.info and d.info
    return p, d, f"unix:{p_sock}", f"unix:{d_sock}"


def held(address: str) -> tuple[int, int]:
    s = daemon_status(address, timeout=5)
    return s.publications, s.pulls_in_flight


def pull_status(address: str, request_id: str) -> pb.PullStatus | None:
    return next((p for p in daemon_status(address, timeout=5).pulls if p.request_id == request_id), None)


def wait_landed(address: str, request_id: str, fraction: float, within: float = 30.0) -> pb.PullStatus:
    """Until the pull has landed at least ``fraction`` of its plan, as D's
    Admin.Status reports it (a fixed sleep is too short where the handshake
    and plan are slow, and the partition then lands before any data)."""
    t0 = time.monotonic()
    while True:
        p = pull_status(address, request_id)
        assert p is not None, f"the pull of {request_id} ended before {fraction:.0%} of it landed"
        if p.planned_bytes and p.landed_bytes >= fraction * p.planned_bytes:
            return p
        assert time.monotonic() - t0 < within, f"{request_id} landed {p.landed_bytes} of {p.planned_bytes} bytes in {within}s (phase {p.phase})"
        time.sleep(0.02)


def wait_nothing_held(address: str, within: float) -> float:
    t0 = time.monotonic()
    while held(address) != (0, 0):
        if time.monotonic() - t0 > within:
            raise AssertionError(f"{address} still holds (publications, pulls) = {held(address)} after {within}s")
        time.sleep(0.1)
    return time.monotonic() - t0


def assert_exact_or_invalid(dw: TestWorker, seed: int, ids: list[int], outcome: str, invalid: set[int]) -> None:
    """Done: every block holds the request's bytes. Failed: exactly the blocks
    reported invalid did not land (D held other bytes there before)."""
    n = len(ids) * 16
    if outcome == "done":
        assert not invalid and dw.mismatch(seed, ids, n) is None
        return
    assert outcome == "failed" and invalid and invalid <= set(ids), (outcome, len(invalid))
    # Write the request's bytes into just the invalid blocks (block 0 takes the
    # landed ones' writes): every block then matches only if each one not
    # called invalid really landed.
    dw.fill(seed, [b if b in invalid else 0 for b in ids])
    assert dw.mismatch(seed, ids, n) is None


def test_a_flapping_link_under_many_requests_leaves_every_byte_exact_or_invalid(daemons, hosts, sockdir):
    _, _, p_addr, d_addr = start_pair(daemons, hosts, sockdir, ("--lease-seconds", "8"), ("--stall-timeout-seconds", "3"))
    pw, dw = make_worker(p_addr, "prefill", **BIG), make_worker(d_addr, "decode", **BIG)
    per, batch = 40, 4  # 10 MiB requests, 4 at a time, over 24 slots of blocks
    outcomes: dict[str, str] = {}
    hosts.start_flapping(seed=1)
    try:
        k = 0
        # At least 24 requests, and more until the link has flapped 3 times:
        # on a quiet machine 24 can finish within the flapper's first up time.
        while k < 24 or (hosts.flaps < 3 and k < 240):
            chunk = [(f"r{i}", 100 + i, list(range(1 + i % 24 * per, 1 + (i % 24 + 1) * per))) for i in range(k, k + batch)]
            k += batch
            for rid, seed, ids in chunk:
                pw.fill(seed, ids)
                dw.fill(seed + 1000, ids)  # what D held before
                dw.client.pull(rid, pw.client.publish(rid, [ids], len(ids) * 16), [ids])
            f = dw.client.wait_finished(recving={rid for rid, _, _ in chunk}, timeout=90)
            for rid, seed, ids in chunk:
                outcome = f.details[("recving", rid)].outcome
                outcomes[rid] = outcome
                assert_exact_or_invalid(dw, seed, ids, outcome, {b for b in f.invalid_block_ids if b in set(ids)})
    finally:
        hosts.stop_flapping()
    assert hosts.flaps >= 3, "the link never flapped during the requests"
    # Nothing held past its lease on either host.
    wait_nothing_held(p_addr, 8 + 5)
    wait_nothing_held(d_addr, 5)
    done = sum(o == "done" for o in outcomes.values())
    print(f"\nflapping link: {hosts.flaps} flaps, {done} of {len(outcomes)} requests done, {len(outcomes) - done} failed with exact invalid blocks")
    assert done > 0


def _big_pull(pw: TestWorker, dw: TestWorker, rid: str = "r") -> list[int]:
    ids = list(range(1, 1000))  # 250 MiB
    pw.fill(7, ids)
    dw.fill(8, ids)
    dw.client.pull(rid, pw.client.publish(rid, [ids], len(ids) * 16), [ids])
    return ids


def test_a_partition_that_heals_before_the_stall_timeout_lets_the_pull_finish(daemons, hosts, sockdir):
    hosts.shape("1gbit")  # 250 MiB takes about 2 s, so the partition lands mid-transfer
    _, _, p_addr, d_addr = start_pair(daemons, hosts, sockdir, (), ("--stall-timeout-seconds", "6"))
    pw, dw = make_worker(p_addr, "prefill", **BIG), make_worker(d_addr, "decode", **BIG)
    ids = _big_pull(pw, dw)
    wait_landed(d_addr, "r", 0.1)
    hosts.link(False)
    time.sleep(0.3)
    stuck = pull_status(d_addr, "r")
    assert stuck is not None, "the pull ended before the partition"
    # Admin.Status (and `kvd status`) shows where it stands: moving data, part landed.
    assert stuck.phase == "data" and 0 < stuck.landed_bytes < stuck.planned_bytes == len(ids) * BLOCK_BYTES, stuck
    time.sleep(1.2)
    hosts.link(True)
    f = dw.client.wait_finished(recving={"r"}, timeout=60)
    assert f.details[("recving", "r")].outcome == "done", f.details[("recving", "r")].reason
    assert_exact_or_invalid(dw, 7, ids, "done", f.invalid_block_ids)
    wait_nothing_held(p_addr, 10)


def test_a_partition_that_does_not_heal_gives_exact_invalid_blocks_and_prefill_releases_at_lease_expiry(daemons, hosts, sockdir):
    hosts.shape("1gbit")
    _, _, p_addr, d_addr = start_pair(daemons, hosts, sockdir, ("--lease-seconds", "4"), ("--stall-timeout-seconds", "2"))
    pw, dw = make_worker(p_addr, "prefill", **BIG), make_worker(d_addr, "decode", **BIG)
    ids = _big_pull(pw, dw)
    wait_landed(d_addr, "r", 0.1)
    hosts.link(False)
    t0 = time.monotonic()
    f = dw.client.wait_finished(recving={"r"}, timeout=30)
    detail = f.details[("recving", "r")]
    assert detail.outcome == "failed" and time.monotonic() - t0 < 8, (detail.outcome, detail.reason)
    assert f.invalid_block_ids < set(ids), "some blocks landed before the partition, and only the rest are invalid"
    assert_exact_or_invalid(dw, 7, ids, "failed", f.invalid_block_ids)
    # P never hears from D again: its lease ends the publication.
    sent = pw.client.wait_finished(sending={"r"}, timeout=30)
    assert sent.details[("sending", "r")].outcome == "expired"
    wait_nothing_held(p_addr, 5)
    wait_nothing_held(d_addr, 5)


def test_a_decode_host_that_vanishes_mid_read_is_released_by_the_prefill_host(daemons, hosts, sockdir):
    hosts.shape("1gbit")
    _, d, p_addr, d_addr = start_pair(daemons, hosts, sockdir, ("--lease-seconds", "3"), ())
    pw, dw = make_worker(p_addr, "prefill", **BIG), make_worker(d_addr, "decode", **BIG)
    _big_pull(pw, dw)
    wait_landed(d_addr, "r", 0.05)
    hosts.link(False)  # the host is gone: no FIN, no RST, nothing
    d.stop(signal.SIGKILL)
    sent = pw.client.wait_finished(sending={"r"}, timeout=30)
    assert sent.details[("sending", "r")].outcome == "expired"
    wait_nothing_held(p_addr, 5)
    # And P keeps serving: a new publication is held and ended by its own lease as usual.
    pw.client.publish("after", [[1, 2]], 32)
    assert held(p_addr)[0] == 1


def test_throughput_over_a_10_gbit_link_kvd_against_a_plain_socket(daemons, hosts, sockdir):
    """Reported, not asserted: kvd's TCP data plane and a plain socket moving
    the same bytes across the shaped link, measured in the same run."""
    hosts.shape("10gbit")
    _, _, p_addr, d_addr = start_pair(daemons, hosts, sockdir)
    pw, dw = make_worker(p_addr, "prefill", **BIG), make_worker(d_addr, "decode", **BIG)
    ids = list(range(1, 1000))
    nbytes = len(ids) * BIG["layers"] * 2 * 16 * BIG["heads"] * BIG["head_size"] * 2
    pw.fill(7, ids)
    ratios = []
    for i in range(3):
        sock_s = plain_socket_seconds(hosts, nbytes, sys.executable)
        rid = f"t{i}"
        t0 = time.perf_counter()
        dw.client.pull(rid, pw.client.publish(rid, [ids], len(ids) * 16), [ids])
        f = dw.client.wait_finished(recving={rid}, timeout=120)
        kvd_s = time.perf_counter() - t0
        assert f.details[("recving", rid)].outcome == "done" and f.details[("recving", rid)].bytes == nbytes
        ratios.append((nbytes / kvd_s / 1e9, nbytes / sock_s / 1e9))
    assert dw.mismatch(7, ids, len(ids) * 16) is None
    worst = min(k / s for k, s in ratios)
    print(f"\n10 Gbit/s tbf veth, {nbytes >> 20} MiB: " + ", ".join(f"kvd {k:.2f} / socket {s:.2f} GB/s" for k, s in ratios)
          + f"; worst ratio {worst:.2f}")
