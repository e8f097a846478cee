"""A reader forgets an engine it has not read from for ``peer_idle_seconds``.

A prefill engine scaled away never fails a pull, so before this nothing
unmapped its memory in the decode daemon (a mapping keeps the pages from the
host however long ago the engine exited) or closed the connections pooled to
it. Real daemons, the same-host path: the mapping is read from
/proc/PID/maps and the connections from /proc/net/tcp.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvd.regions.shm import unlink_name
from tests.conftest import make_worker, shm_mapped, wait_for


def _connected_to(port: int) -> int:
    """Established TCP connections whose far end is ``port`` on this host."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "01" and int(fields[2].rsplit(":", 1)[1], 16) == port:
                count += 1
    return count


def _pull(p, d, rid: str, seed: int) -> None:
    p.fill(seed, [1, 2])
    d.client.pull(rid, p.client.publish(rid, [[1, 2]], 32), [[3, 4]])
    f = d.client.wait_finished(recving={rid})
    assert f.details[("recving", rid)].outcome == "done", f.details
    assert d.mismatch(seed, [3, 4], 32) is None


@pytest.mark.parametrize("idle", [1.0, 300.0], ids=["forgotten", "kept"])
def test_an_engine_not_read_from_is_forgotten_and_handshaken_again(daemons, idle):
    p = daemons.start("prefill", same_host="auto")
    d = daemons.start("decode", "--peer-idle-seconds", str(idle), same_host="auto")
    pw, dw = make_worker(p.grpc, "prefill"), make_worker(d.grpc, "decode")
    _pull(pw, dw, "first", 1)
    data_port = int(p.info["data"].rsplit(":", 1)[1])
    owners = shm_mapped(d.pid) & shm_mapped(p.pid)  # the owner's regions, mapped by the reader too
    assert owners, "the reader took the same-host path"
    assert _connected_to(data_port) >= 1  # a connection pooled to the owner (the reads' authorisation)
    if idle > 10:  # the control: well inside the idle time, everything is kept
        time.sleep(3)
        assert owners <= shm_mapped(d.pid)
        assert _connected_to(data_port) >= 1
        return
    wait_for(lambda: not owners & shm_mapped(d.pid), 15, "the reader to unmap the idle owner's memory")
    wait_for(lambda: _connected_to(data_port) == 0, 5, "the connections pooled to the idle owner to close")
    # Logged once forgetting is done (after the connections closed): waited for, not raced.
    wait_for(lambda: "forgot engine=prefill" in d.log(), 5, "the reader to log that it forgot the owner")
    _pull(pw, dw, "again", 2)  # handshaken and mapped again
    assert owners <= shm_mapped(d.pid)


def _readers(daemon) -> float:
    from kvd.testing.metrics import scrape

    return scrape(daemon.metrics_url, "kvd_readers")


@pytest.mark.parametrize("reader_idle", [1.0, 300.0], ids=["reader-left", "reader-connected"])
def test_an_owner_forgets_a_reader_that_left_and_keeps_one_still_connected(daemons, reader_idle):
    """The owner's side: a reader's handshake is kept while it holds a data
    connection, and forgotten once it has neither read nor stayed connected
    for peer_idle_seconds (here 1 s on the owner). The control: a reader that
    keeps its connection pooled (its own idle time 300 s) is kept, and reads
    again on the same handshake."""
    p = daemons.start("prefill", "--peer-idle-seconds", "1")
    d = daemons.start("decode", "--peer-idle-seconds", str(reader_idle))
    pw, dw = make_worker(p.grpc, "prefill"), make_worker(d.grpc, "decode")
    _pull(pw, dw, "first", 1)
    assert _readers(p) == 1
    if reader_idle > 10:
        time.sleep(3)  # three times the owner's idle time: the pooled connection keeps the reader
        assert _readers(p) == 1
        _pull(pw, dw, "again", 2)
        assert "forgot reader" not in p.log()
        return
    wait_for(lambda: _readers(p) == 0, 15, "the owner to forget the reader that left")
    wait_for(lambda: "forgot reader engine=decode" in p.log(), 5, "the owner to log that it forgot the reader")  # logged after the count
    _pull(pw, dw, "again", 2)  # the reader handshakes again and lands exactly
    assert _readers(p) == 1


def test_a_reader_rescheduled_under_a_new_address_replaces_its_old_entry(daemons):
    """A decode daemon that restarts under another address (a pod
    rescheduled) holds the same rank: the owner keeps one entry of it, not
    one per address it ever had (before, the old entry stayed for the
    owner's life)."""
    p = daemons.start("prefill")
    pw = make_worker(p.grpc, "prefill")
    first = daemons.start("decode")
    _pull(pw, make_worker(first.grpc, "decode"), "before", 1)
    first.stop()
    second = daemons.start("decode")  # new ports: a new data address, the same rank
    _pull(pw, make_worker(second.grpc, "decode"), "after", 2)
    assert _readers(p) == 1


def _remove_and_see_unmapped(d, owners: set[str]) -> None:
    """The owner's worker lets its memory go, as kvd.caches.release_all does: the reader must unmap it."""
    for name in owners:
        assert unlink_name(name)
    wait_for(lambda: not owners & shm_mapped(d.pid), 10, f"the reader to unmap {owners}, removed by their worker")


def test_a_reader_unmaps_an_owners_memory_once_its_worker_let_it_go(daemons):
    """A same-host reader maps the owner's regions; once the owner's worker
    ends and its file is removed (kvd.caches.release_all, or the owner's
    daemon after the worker's process died), that mapping alone keeps the
    pages from the host. Before, it lasted until the owner went idle
    (peer_idle_seconds, 300 s by default); now the reader sees the removal
    within a few seconds and unmaps, and a pull from the worker that comes
    next (new memory) handshakes again and lands. The control: a worker that
    unregistered but keeps its file (it may register it again) stays mapped."""
    p = daemons.start("prefill", same_host="auto")
    d = daemons.start("decode", same_host="auto")  # peer_idle_seconds: the default, 300
    pw, dw = make_worker(p.grpc, "prefill"), make_worker(d.grpc, "decode")
    _pull(pw, dw, "first", 1)
    owners = shm_mapped(d.pid) & shm_mapped(p.pid)
    assert owners, "the reader took the same-host path"
    pw.client.unregister()
    time.sleep(5)  # over two of the reader's checks
    assert owners <= shm_mapped(d.pid), "unregistered, its file still there: kept"
    _remove_and_see_unmapped(d, owners)
    wait_for(lambda: "unmapping engine=prefill's same-host memory" in d.log(), 5, "the reader to log why it unmapped")
    again = make_worker(p.grpc, "prefill")  # the rank's next worker, in new memory
    _pull(again, dw, "again", 2)
    now = shm_mapped(d.pid) & shm_mapped(p.pid)
    assert now and not now & owners, (now, owners)


def test_an_owner_unmapped_for_its_removed_memory_is_still_forgotten_when_idle(daemons):
    """Unmapping an ended worker's memory (above) keeps the engine known: once
    it goes unread for peer_idle_seconds, its pooled connections close and it
    is forgotten, as any idle engine. Negative control: dropping the engine's
    handshake to unmap, which left forget_idle nothing to close: the
    connection stayed open."""
    p = daemons.start("prefill", same_host="auto")
    d = daemons.start("decode", "--peer-idle-seconds", "6", same_host="auto")  # checked every 1.5 s
    pw, dw = make_worker(p.grpc, "prefill"), make_worker(d.grpc, "decode")
    _pull(pw, dw, "first", 1)
    data_port = int(p.info["data"].rsplit(":", 1)[1])
    owners = shm_mapped(d.pid) & shm_mapped(p.pid)
    assert owners and _connected_to(data_port) >= 1
    pw.client.unregister()
    _remove_and_see_unmapped(d, owners)
    assert "unmapping engine=prefill's same-host memory" in d.log() and "forgot engine=prefill" not in d.log()
    wait_for(lambda: _connected_to(data_port) == 0, 15, "the connections pooled to the idle owner to close")
    wait_for(lambda: "forgot engine=prefill" in d.log(), 5, "the reader to log that it forgot the owner")
