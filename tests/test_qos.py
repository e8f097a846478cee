"""Transfers on a contended wire, between real daemons (``--qos on``): an
interactive pull is not kept behind bulk ones, tenants are named by the
daemon's config, and bad fields are refused by name."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

import pytest

from kvd.client import daemon_status
from kvd.core.errors import InvalidArgument
from kvd.testing.metrics import scrape
from tests.conftest import make_worker

BIG = dict(layers=4, heads=8, head_size=128, block_size=256)  # 1 MiB a block a layer: 4 MiB a block
BULK = 64  # blocks: 256 MiB a pull (--qos on: four reads of qos_read_bytes, 64 MiB; off: striped over two connections)


def finish_times(worker, rids: set[str], timeout: float = 120) -> dict[str, float]:
    """When each of ``rids`` reached the worker's finished set, and every one landed."""
    seen: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    while set(seen) != rids:
        assert time.monotonic() < deadline, f"not finished: {rids - set(seen)}"
        f = worker.client.get_finished()
        for rid, detail in f.details.items():
            assert detail.outcome == "done", (rid, detail)
            seen[rid[1]] = time.perf_counter()
        time.sleep(0.0005)
    return seen


def on_wire(address: str, request_ids: tuple[str, ...], within: float = 10.0) -> None:
    """Until D's pulls of ``request_ids`` (accepted: listed until they end)
    have planned and asked for connections. A fixed sleep guessed it, and a
    small pull sent early could take a connection first."""
    t0 = time.monotonic()
    while any(x.request_id in request_ids and x.phase in ("queued", "resolve", "handshake", "plan") for x in daemon_status(address).pulls):
        assert time.monotonic() - t0 < within, f"{request_ids} did not reach the wire in {within}s"
        time.sleep(0.002)


def bulk_then_small(daemons, qos: str) -> dict[str, float]:
    """Two bulk pulls (class standard) hold every pooled connection; then a
    small interactive one. When each finished."""
    p = daemons.start(f"prefill-{qos}", "--qos", qos)
    d = daemons.start(f"decode-{qos}", "--qos", qos)
    pw = make_worker(p.grpc, f"prefill-{qos}", num_blocks=BULK + 2, **BIG)
    dw = make_worker(d.grpc, f"decode-{qos}", num_blocks=2 * BULK + 3, **BIG)
    bulk, small = list(range(1, BULK + 1)), [BULK + 1]
    pw.fill(3, bulk)
    pw.fill(3, small)  # its own request: tokens from 0
    warm = pw.client.publish("warm", [small], 256)
    dw.client.pull("warm", warm, [[2 * BULK + 1]])
    dw.client.wait_finished(recving={"warm"})
    params = {rid: pw.client.publish(rid, [ids], len(ids) * 256) for rid, ids in (("bulk-a", bulk), ("bulk-b", bulk), ("small", small))}
    dw.client.pull("bulk-a", params["bulk-a"], [list(range(1, BULK + 1))])
    dw.client.pull("bulk-b", params["bulk-b"], [list(range(BULK + 1, 2 * BULK + 1))])
    on_wire(d.grpc, ("bulk-a", "bulk-b"))
    started = time.perf_counter()
    dw.client.pull("small", params["small"], [[2 * BULK + 2]], priority="interactive")
    done = finish_times(dw, {"bulk-a", "bulk-b", "small"})
    assert dw.mismatch(3, [2 * BULK + 2], 256) is None  # landed whole (its D block is P's block BULK + 1)
    return {rid: t - started for rid, t in done.items()}


def test_an_interactive_pull_does_not_wait_behind_bulk_pulls(daemons):
    """With --qos on the small pull has connections of its own and the
    owner sends its chunks first: it lands early in the bulk pulls' time
    (under 0.3 of the first bulk pull's). The control, --qos off: it queues
    for a connection behind the bulk reads and lands only once one of their
    stripes ended, which misses that bound (0.54-0.97 in 5 runs here)."""
    on = bulk_then_small(daemons, "on")
    off = bulk_then_small(daemons, "off")
    share = {k: t["small"] / min(t["bulk-a"], t["bulk-b"]) for k, t in (("on", on), ("off", off))}
    print(f"\nthe small pull's time / the first bulk pull's: {share}")
    assert share["on"] < 0.3 <= share["off"], (share, on, off)


def test_streaming_reads_that_wait_for_prefill_hold_no_place_on_the_wire(daemons):
    """--qos on, layer-wise streaming: two reads (as many as the wire's
    places, qos_slots) have sent their first layer and wait for prefill to
    save the next. They hold no place on the wire meanwhile, so a bulk pull
    takes about as long as with nothing else on it. The control, before the
    fix: each asked for the wire again as its layer ended, was granted, and
    held the place while it waited, so every chunk of the bulk pull waited
    out the 0.25 s bound (64 MiB in 8.5 s against 0.48 s alone). No chunk of
    it waits out the bound either (with only the bound's own remedy, places
    held past it stop counting, one chunk would)."""
    p = daemons.start("prefill", "--qos", "on")
    d = daemons.start("decode", "--qos", "on")
    pw = make_worker(p.grpc, "prefill", num_blocks=24, **BIG)
    dw = make_worker(d.grpc, "decode", num_blocks=40, **BIG)
    bulk, streams = list(range(1, 17)), {"s1": ([17, 18], [33, 34]), "s2": ([19, 20], [35, 36])}  # rid: (P's ids, D's)
    pw.fill(5, bulk)
    for p_ids, _ in streams.values():
        pw.fill(6, p_ids)  # each its own request: tokens from 0

    def bulk_pull(rid: str, d_ids: list[int]) -> float:
        t0 = time.perf_counter()
        dw.client.pull(rid, pw.client.publish(rid, [bulk], len(bulk) * 256), [d_ids])
        assert dw.client.wait_finished(recving={rid}).details[("recving", rid)].outcome == "done"
        assert dw.mismatch(5, d_ids, len(bulk) * 256) is None
        return time.perf_counter() - t0

    alone = bulk_pull("alone", list(range(1, 17)))
    sent = scrape(p.metrics_url, "kvd_sent_bytes_total")
    for rid, (p_ids, d_ids) in streams.items():
        dw.client.pull(rid, pw.client.publish(rid, [p_ids], 512, stream=True), [d_ids])
    pw.client.layers_saved(list(streams), 1, wait=True)
    t0 = time.monotonic()
    while scrape(p.metrics_url, "kvd_sent_bytes_total") < sent + 4 * (1 << 20):  # layer 0 of both: 2 blocks x 1 MiB each
        assert time.monotonic() - t0 < 30, "the streams' first layer did not leave"
        time.sleep(0.01)
    waits = {le: scrape(p.metrics_url, "kvd_qos_wait_seconds_bucket", le=le) for le in ("0.25", "+Inf")}
    loaded = bulk_pull("loaded", list(range(17, 33)))
    past_bound = scrape(p.metrics_url, "kvd_qos_wait_seconds_bucket", le="+Inf") - waits["+Inf"] - (
        scrape(p.metrics_url, "kvd_qos_wait_seconds_bucket", le="0.25") - waits["0.25"])
    print(f"\n64 MiB bulk pull alone: {alone:.2f}s; beside two streaming reads waiting for prefill: {loaded:.2f}s")
    assert dw.client.get_finished().finished_recving == set()  # the streams still wait
    pw.client.layers_saved(list(streams), 4, wait=True)
    dw.client.wait_finished(recving=set(streams))
    for _, d_ids in streams.values():
        assert dw.mismatch(6, d_ids, 512) is None
    assert loaded < 3 * alone + 1.0, (alone, loaded)
    assert past_bound == 0, f"{past_bound:.0f} of the bulk pull's chunks waited out the 0.25 s bound"


def test_tenants_shares_and_queues_are_counted_and_shown(daemons):
    """Both daemons know the tenants; P grants its sends by them, and
    ``kvd status`` shows the wire's queues per class and tenant."""
    p = daemons.start("prefill", "--tenants", "gold=3,silver=1")
    d = daemons.start("decode", "--tenants", "gold=3,silver=1")
    pw = make_worker(p.grpc, "prefill", num_blocks=10, **BIG)
    dw = make_worker(d.grpc, "decode", num_blocks=10, **BIG)
    pw.fill(4, [1, 2])
    for rid, tenant, ids in (("g", "gold", [1, 2]), ("s", "silver", [3, 4])):
        dw.client.pull(rid, pw.client.publish(rid, [[1, 2]], 512), [ids], tenant=tenant, deadline_ms=500)
    dw.client.wait_finished(recving={"g", "s"})
    assert dw.mismatch(4, [1, 2], 512) is None
    for tenant in ("gold", "silver"):
        assert scrape(p.metrics_url, "kvd_qos_bytes_total", priority="standard", tenant=tenant) == 2 * 4 << 20
    r = subprocess.run([sys.executable, "-m", "kvd", "status", p.grpc, "--json"], capture_output=True, text=True, timeout=60)
    queues = {(q["side"], q["priority"], q["tenant"]): q for q in json.loads(r.stdout)["queues"]}
    assert int(queues[("send", "standard", "gold")]["grantedBytes"]) == 8 << 20, queues
    r = subprocess.run([sys.executable, "-m", "kvd", "status", d.grpc, "--json"], capture_output=True, text=True, timeout=60)
    reads = [q for q in json.loads(r.stdout)["queues"] if q["side"].startswith("read ")]
    assert {q["tenant"] for q in reads} == {"gold", "silver"} and all(q.get("moving", 0) == 0 for q in reads), reads  # D's reads, all done
    r = subprocess.run([sys.executable, "-m", "kvd", "status", p.grpc], capture_output=True, text=True, timeout=60)
    assert "the wire's queues" in r.stdout and "silver" in r.stdout, r.stdout


@pytest.mark.parametrize(("qos", "field"), [
    (dict(priority="urgent"), "priority"),
    (dict(deadline_ms=-5.0), "deadline_ms"),
    (dict(tenant="mallory"), "tenant"),
])
def test_bad_qos_fields_are_refused_by_name_and_the_daemon_serves_on(daemons, qos, field):
    p = daemons.start("prefill")
    d = daemons.start("decode", "--tenants", "gold=3")
    pw, dw = make_worker(p.grpc, "prefill"), make_worker(d.grpc, "decode")
    pw.fill(1, [1])
    params = pw.client.publish("r1", [[1]], 16)
    with pytest.raises(InvalidArgument) as e:
        dw.client.pull("r1", params, [[2]], **qos)
    assert e.value.code.name == "INVALID_ARGUMENT" and field in e.value.message, e.value.message
    dw.client.pull("r1", params, [[2]], priority="interactive", tenant="gold", deadline_ms=100)
    assert dw.client.wait_finished(recving={"r1"}).details[("recving", "r1")].outcome == "done"


@pytest.mark.parametrize(("flags", "says"), [
    (["--tenants", "gold"], "tenants"),
    (["--tenants", "gold=0"], "tenants"),
    (["--qos", "sometimes"], "qos"),
    (["--qos-read-bytes", "4096"], "qos_read_bytes"),
    (["--qos-bulk-nice", "20"], "qos_bulk_nice"),
])
def test_a_bad_qos_config_is_refused_naming_the_key(flags, says):
    r = subprocess.run([sys.executable, "-m", "kvd", "serve", "--engine-id", "x", *flags], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and says in r.stderr and flags[1] in r.stderr, r.stderr


def test_the_demo_names_tenants_end_to_end():
    r = subprocess.run([sys.executable, "-m", "kvd", "demo", "--requests", "16", "--tenants", "gold=3,silver=1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    line = next(x for x in r.stdout.splitlines() if x.strip().startswith("--tenants"))
    assert "gold" in line and "silver" in line and "verified" in r.stdout, r.stdout[-2000:]


def thread_stats(pid: int) -> dict[int, tuple[int, int]]:
    """Each thread's CPU time so far (clock ticks, user + system) and nice value, from /proc."""
    out = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/stat") as f:  # OSError: a thread that ended meanwhile
            fields = f.read().rsplit(")", 1)[1].split()  # fields from the 3rd (state) on
            out[int(task)] = (int(fields[11]) + int(fields[12]), int(fields[16]))
    return out


def cpu_by_nice(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]], base: int) -> dict[int, int]:
    """Clock ticks threads spent between two ``thread_stats``, by their nice above ``base``."""
    out: dict[int, int] = {}
    for tid, (ticks, nice) in after.items():
        out[nice - base] = out.get(nice - base, 0) + ticks - before.get(tid, (0, 0))[0]
    return out


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own nice value is Linux's")
@pytest.mark.alone  # which threads got the CPU: another test's processes beside it would take their share
@pytest.mark.parametrize(("priority", "increment", "reader_qos", "niced", "d_layout", "same_host"), [
    ("standard", "10", "on", True, "NHD", "off"),
    # Controls: after the bulk pull niced threads on both sides, an interactive
    # pull's work runs at the daemon's priority; and --qos-bulk-nice 0 nices nothing.
    ("interactive", "10", "on", False, "NHD", "off"),
    ("standard", "10", "on", True, "HND", "off"),  # D relays out on copy threads: a bulk read's are niced too
    ("interactive", "10", "on", False, "HND", "off"),
    ("standard", "10", "on", True, "NHD", "auto"),  # same host: D copies P's memory on copy threads
    ("interactive", "10", "on", False, "NHD", "auto"),
    ("standard", "0", "on", False, "NHD", "off"),
    # A reader with qos off may send any class on any connection: the owner
    # (qos on) never nices a thread that may next serve an interactive read.
    ("standard", "10", "off", False, "NHD", "off"),
], ids=["bulk", "interactive", "bulk-relayout", "interactive-relayout", "bulk-same-host", "interactive-same-host", "nice-0", "reader-qos-off"])
def test_bulk_reads_move_in_threads_that_yield_the_cpu(daemons, priority, increment, reader_qos, niced, d_layout, same_host):
    """--qos on: the threads that send (P) and receive (D) a read below
    class interactive run --qos-bulk-nice above the daemon's nice value, so
    that on a busy host an interactive read's threads come first; so do D's
    threads that land a bulk read in another layout, or copy it from P's
    memory on the same host. Which threads did a pull's work is read from
    each thread's CPU time, and the bytes still land whole."""
    flags = ("--qos-bulk-nice", increment)
    p = daemons.start("prefill", "--qos", "on", *flags, same_host=same_host)
    d = daemons.start("decode", "--qos", reader_qos, *flags, same_host=same_host)
    pw = make_worker(p.grpc, "prefill", num_blocks=BULK + 1, **BIG)
    dw = make_worker(d.grpc, "decode", num_blocks=BULK + 1, layout=d_layout, **BIG)
    blocks = list(range(1, BULK + 1))
    pw.fill(7, blocks)
    base = {side.pid: thread_stats(side.pid)[side.pid][1] for side in (p, d)}
    if max(base.values()) + 10 > 19:
        pytest.skip(f"the daemons run at nice {max(base.values())}: 10 above it is past 19")

    def pull(rid: str, cls: str) -> None:
        dw.client.pull(rid, pw.client.publish(rid, [blocks], BULK * 256), [blocks], priority=cls)
        assert dw.client.wait_finished(recving={rid}).details[("recving", rid)].outcome == "done"
        assert dw.mismatch(7, blocks, BULK * 256) is None

    pull("bulk", "standard")  # with the default, it leaves niced threads on both sides
    before = {pid: thread_stats(pid) for pid in base}
    for k in range(4):  # 1 GiB: tens of clock ticks of each side's data threads
        pull(f"measured-{k}", priority)
    # Same host, D copies P's memory itself: P's threads move nothing.
    for side, pid in (("P", p.pid), ("D", d.pid)) if same_host == "off" else (("D", d.pid),):
        now = thread_stats(pid)
        now.pop(pid)  # the main thread: the event loop, the daemon's control plane (at its priority)
        cpu = cpu_by_nice(before[pid], now, base[pid])
        print(f"\n{side}, {priority}, --qos-bulk-nice {increment}, reader qos {reader_qos}: the pulls' CPU ticks by nice above the daemon's: {cpu}")
        assert set(cpu) <= {0, 10}, (side, cpu)
        at = 10 if niced else 0  # where the data threads ran: most of the pulls' CPU
        assert cpu.get(at, 0) > 2 * cpu.get(10 - at, 0), (side, priority, increment, cpu)
