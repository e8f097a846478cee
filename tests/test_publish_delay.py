"""How long after the forward that computed a prompt P published it
(``kvd_publish_delay_seconds``): the engine's forward clock in shared memory,
and a real daemon observing the stamp a publication carries. (Real vLLM
engines stamp it too: tests/test_vllm.py.)"""

from __future__ import annotations

import os
import time
from pathlib import Path

from kvd.client import KvdClient, daemon_status
from kvd.core.spec import WorkerId
from kvd.integrations.vllm_clock import RING, ForwardClock
from tests.conftest import make_worker, scrape


def test_the_forward_clock_gives_the_last_rank_to_end_and_only_for_its_step():
    clock = ForwardClock.create(ranks=2)
    try:
        # Its pages are reserved, not a sparse file: a full /dev/shm refuses it, never a stamp with SIGBUS.
        assert os.stat(clock.path).st_blocks * 512 >= 2 * RING * 16
        worker = ForwardClock.open(clock.path)  # what another process maps
        assert worker is not None
        worker.stamp(0, 7, 1_000)
        assert clock.ended(7) == 1_000 and not clock.all_stamped()
        worker.stamp(1, 7, 1_500)  # the forward ends with its last rank
        assert clock.ended(7) == 1_500 and clock.all_stamped()
        # Every rank has mapped it: its name goes, and nothing is left should the engine be killed;
        # the mappings go on working.
        clock.unlink()
        assert not Path(clock.path).exists()
        worker.stamp(1, 30, 2_000)
        assert clock.ended(30) == 2_000
        assert clock.ended(8) == 0  # a step no rank stamped
        worker.stamp(0, 7 + RING, 9_000)  # the ring moved on: step 7's slot of rank 0 is another step's now
        assert clock.ended(7) == 1_500 and clock.ended(7 + RING) == 9_000
        worker.stamp(5, 9, 1)  # a rank the file has no room for stamps nothing
        assert clock.ended(9) == 0
        worker.close()
    finally:
        clock.close()
    assert not Path(clock.path).exists()  # the scheduler's copy removes the file
    assert ForwardClock.open(clock.path) is None  # and a worker that comes later stamps nothing


def _delay(metrics_url: str, by: str) -> tuple[float, float]:
    return (scrape(metrics_url, "kvd_publish_delay_seconds_count", by=by), scrape(metrics_url, "kvd_publish_delay_seconds_sum", by=by))


def test_a_publication_stamped_with_its_forward_end_is_observed_by_who_published_it(daemons):
    p = daemons.start("prefill")
    w = make_worker(p.grpc, "prefill")
    assert _delay(p.metrics_url, "worker") == (0, 0) and _delay(p.metrics_url, "engine") == (0, 0)
    # A worker's publication of a forward that ended 300 ms ago.
    w.client.publish("r1", [[1, 2]], 32, computed_at_ns=time.time_ns() - 300_000_000)
    count, total = _delay(p.metrics_url, "worker")
    assert count == 1 and 0.3 <= total < 30, total
    # None without a stamp, or with one that cannot be this host's clock (ahead of it, or
    # from 1970): not observed, and the publication is not refused for it.
    w.client.publish("r2", [[3]], 16)
    w.client.publish("r3", [[4]], 16, computed_at_ns=time.time_ns() + 60_000_000_000)
    w.client.publish("r4", [[5]], 16, computed_at_ns=1)
    assert _delay(p.metrics_url, "worker") == (count, total)
    assert {x.request_id for x in daemon_status(p.grpc).leases} >= {"r1", "r2", "r3", "r4"}
    # The engine's scheduler, for every rank at once.
    sched = KvdClient(p.grpc, WorkerId("prefill"))
    sched.worker_token = w.client.worker_token
    sched.publish_engine("r5", [[6]], 16, computed_at_ns=time.time_ns() - 2_000_000)
    count, total = _delay(p.metrics_url, "engine")
    assert count == 1 and 0.002 <= total < 30, total

