"""What a daemon tells its operator about its own time: where each pull's
time goes (``kvd_pull_phase_seconds``), how long P takes to serve a read,
and an event loop that stops answering (the watchdog)."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Histogram

from kvd.daemon.metrics import PULL_PHASES as PHASES
from kvd.daemon.watchdog import LoopWatchdog
from kvd.testing.daemons import DaemonDidNotStart, parent_death_term, run_delay
from kvd.testing.metrics import samples
from tests.conftest import make_worker, scheduler_params, scrape, transfer


def _phases(metrics_url: str, stat: str) -> dict[str, float]:
    return {ph: scrape(metrics_url, f"kvd_pull_phase_seconds_{stat}", phase=ph) for ph in PHASES}


def test_each_pull_is_timed_by_phase_and_resolve_only_when_params_predate_the_publish(daemons):
    p, d = daemons.start("prefill"), daemons.start("decode")
    pw, dw = make_worker(p.grpc, "prefill"), make_worker(d.grpc, "decode")
    assert _phases(d.metrics_url, "count") == dict.fromkeys(PHASES, 0.0)  # exported before any pull
    transfer([pw], [dw], "r1", 1, [1, 2], [3, 4], 32)
    counts = _phases(d.metrics_url, "count")
    # Published params carry their generation: nothing to resolve.
    assert counts == {**dict.fromkeys(PHASES, 1.0), "resolve": 0.0, "verify": 0.0}, counts  # verification is off by default
    pw.client.wait_finished(sending={"r1"}, timeout=10)  # P timed its read as it sent END: it reports sending after D's ACK
    assert scrape(p.metrics_url, "kvd_read_serve_seconds_count") == 1
    # The phases are parts of the pull: together no longer than it, and the transfer its larger part.
    sums = _phases(d.metrics_url, "sum")
    assert 0 < sum(sums.values()) <= scrape(d.metrics_url, "kvd_transfer_duration_seconds_sum") + sums["queued"] + sums["report"]
    assert sums["transfer"] > 0 and sums["plan"] > 0
    # Params made before P published (as vLLM's scheduler makes them): D resolves them first.
    cap = secrets.token_bytes(32)
    pw.fill(2, [5])
    params = scheduler_params(p.grpc, "prefill", "p-r2", cap, [5], 16)
    params.remote_tp_size = 1
    dw.client.pull("r2", params, [[6]])
    time.sleep(0.3)
    pw.client.publish("p-r2", [[5]], 16, capability=cap)
    f = dw.client.wait_finished(recving={"r2"}, timeout=30)
    assert f.details[("recving", "r2")].outcome == "done" and dw.mismatch(2, [6], 16) is None
    counts = _phases(d.metrics_url, "count")
    assert counts == dict.fromkeys(PHASES, 2.0) | {"resolve": 1.0, "verify": 0.0}, counts
    assert scrape(d.metrics_url, "kvd_pull_phase_seconds_sum", phase="resolve") >= 0.2  # it waited for the publish


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """A real event loop running on its own thread, as the daemon's runs on its main thread."""
    lp = asyncio.new_event_loop()
    t = threading.Thread(target=lp.run_forever, daemon=True)
    t.start()
    yield lp
    lp.call_soon_threadsafe(lp.stop)
    t.join(5)
    lp.close()


def _watch(loop: asyncio.AbstractEventLoop) -> tuple[LoopWatchdog, Histogram]:
    lag = Histogram("lag_seconds", "", registry=CollectorRegistry(), buckets=(0.1, 1.0))
    dog = LoopWatchdog(loop, lag, interval=0.05, warn_after=0.6)
    started = threading.Event()

    def start() -> None:
        dog.start()  # on the loop's thread, as the daemon starts it
        started.set()

    loop.call_soon_threadsafe(start)
    assert started.wait(5)
    return dog, lag


def _hold_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # a handler that blocks instead of awaiting


def _samples(lag: Histogram) -> dict[str, float]:
    return {s.name.removeprefix("lag_seconds_") + s.labels.get("le", ""): s.value for m in lag.collect() for s in m.samples}


def test_a_blocked_loop_is_logged_with_where_it_blocks_and_counted(loop, caplog):
    dog, lag = _watch(loop)
    try:
        with caplog.at_level(logging.WARNING, logger="kvd.daemon"):
            time.sleep(0.3)  # a few prompt pings first: the control
            quiet = _samples(lag)
            loop.call_soon_threadsafe(_hold_the_loop, 2.0)  # a second past the 1 s bucket: room for a late ping
            deadline = time.monotonic() + 8
            while "ran again" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        dog.stop()
    assert quiet["count"] >= 2 and quiet["bucket1.0"] == quiet["count"], quiet  # no ping over a second before the block
    blocked = [r.getMessage() for r in caplog.records if "blocked for" in r.getMessage()]
    assert len(blocked) == 1, caplog.text  # once a stall, not once a ping
    assert "_hold_the_loop" in blocked[0] and "time.sleep(seconds)" in blocked[0], blocked[0]
    after = _samples(lag)
    assert after["count"] - after["bucket1.0"] == 1, after  # the one ping that waited out the block
    assert after["sum"] - quiet["sum"] >= 1.0, after


def test_a_loop_that_keeps_running_is_never_logged(loop, caplog):
    dog, lag = _watch(loop)
    try:
        with caplog.at_level(logging.WARNING, logger="kvd.daemon"):
            for _ in range(10):
                loop.call_soon_threadsafe(_hold_the_loop, 0.02)  # short handlers, as a daemon runs them
                time.sleep(0.05)
    finally:
        dog.stop()
    assert "blocked" not in caplog.text
    assert _samples(lag)["count"] >= 4


def test_a_daemon_scrapes_its_loop_lag(daemons):
    d = daemons.start("p")
    deadline = time.monotonic() + 10
    while scrape(d.metrics_url, "kvd_event_loop_lag_seconds_count") < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert scrape(d.metrics_url, "kvd_event_loop_lag_seconds_count") >= 2
    assert "event loop blocked" not in d.log_path.read_text()


def test_sigusr1_writes_every_threads_stack_to_the_log_and_the_daemon_serves_on(daemons):
    """Where a stuck daemon is stuck, for its operator and for a test's failure message (CI keeps no
    files): faulthandler writes from the signal handler, so it answers even when no Python thread
    can run. The negative control is SIGUSR1's default action, which ends the process."""
    p, d = daemons.start("prefill"), daemons.start("decode")
    pw, dw = make_worker(p.grpc, "prefill"), make_worker(d.grpc, "decode")
    transfer([pw], [dw], "before", 1, [1, 2], [3, 4], 32)
    stacks = p.stacks()
    assert stacks.count("Thread 0x") >= 4, stacks  # every thread: the loop's, the watchdog's, the metrics server's, gRPC's ...
    assert "kvd/daemon/server.py" in stacks and "kvd/daemon/watchdog.py" in stacks, stacks
    assert p.proc.poll() is None
    _, finished = transfer([pw], [dw], "after", 2, [5, 6], [7, 8], 32)  # it serves on, exactly
    assert finished[0].details[("recving", "after")].outcome == "done" and dw.mismatch(2, [7, 8], 32) is None
    assert "Thread 0x" not in d.log(), "only the daemon signalled writes its stacks"


def test_a_daemon_not_ready_in_time_says_where_it_is(daemons, tmp_path):
    """A start that does not finish (here its config is a pipe nobody writes, so opening it waits)
    fails with the daemon's state, its CPU time and every thread's stack: starved, stuck or busy, and
    where. Negative control: faulthandler set up only once the daemon's imports are done, SIGUSR1
    ended the daemon and the message held no stack."""
    fifo = tmp_path / "kvd.yaml"
    os.mkfifo(fifo)
    p = daemons.start("prefill", "--config", str(fifo))
    p.ready_within = 8
    with pytest.raises(DaemonDidNotStart) as e:
        p.info  # noqa: B018 (waits for its ready file)
    said = str(e.value)
    assert "not ready within 8 s of its own time or 240 s of wall time (state S, " in said and " s system CPU since it started, " in said, said
    assert said.rstrip().endswith(" s waiting for a CPU)"), said[-300:]  # the summary ends it too: the demo's caller may keep only a tail
    assert "Current thread 0x" in said and "kvd/daemon/config.py" in said, said  # the main thread, opening the config


@pytest.mark.alone  # it takes one core for several seconds: the real engines' core, in make test's engine pass
def test_a_daemon_starved_of_cpu_is_waited_for(daemons):
    """A daemon kept off the CPU by busier processes is slow, not stuck: its start is judged by its own
    time, wall time less its main thread's wait for a CPU, so ``kvd demo`` on a loaded machine does not
    give up on it (CI: a daemon of the own pass, at nice 10 beside the real engines, still importing
    after 60 s; reproduced here with three spinning processes on each core: state R, 1.9 s of CPU in
    60 s). Here eight spinning processes share its one core, so it starts in several times its own
    time (6 s). A stuck one is still caught (the test above). Negative control: judged by wall time (its
    wait not subtracted), the same start fails."""
    if run_delay(os.getpid()) is None:
        pytest.skip("this kernel keeps no run delay (/proc/PID/schedstat)")
    core = min(os.sched_getaffinity(0))
    # Bounded, and ended with this process however it ends (SIGTERM at its death: no spinner outlives it).
    spin = f"import os, time\nos.sched_setaffinity(0, {{{core}}})\nend = time.monotonic() + 120\nwhile time.monotonic() < end:\n    pass"
    hogs = [subprocess.Popen([*parent_death_term(), sys.executable, "-c", spin]) for _ in range(8)]
    try:
        p = daemons.start("prefill", prefix=["taskset", "-c", str(core)])
        p.ready_within, p.starved_within = 6, 240
        started = time.monotonic()
        assert p.info["pid"] == p.pid
        wall = time.monotonic() - started
        assert wall > p.ready_within, f"not starved: ready in {wall:.1f} s ({p.cpu()})"  # so wall time alone would have failed it
        assert p.cpu_wait() > wall - p.ready_within, p.cpu()
    finally:
        for h in hogs:
            h.kill()
            h.wait()


def test_a_daemon_runs_each_background_loop_under_a_counted_restart(daemons):
    """Every background loop is started by ``keep_running`` (its failures
    counted by name from 0, ``test_background``), and a daemon that moved a
    request has none."""
    p, d = daemons.start("prefill"), daemons.start("decode")
    pw, dw = make_worker(p.grpc, "prefill"), make_worker(d.grpc, "decode")
    pw.fill(2, [1])
    dw.client.pull("r", pw.client.publish("r", [[1]], 16), [[1]])
    dw.client.wait_finished(recving={"r"})
    for side in (p, d):
        counts = {s.labels["loop"]: s.value for s in samples(side.metrics_url) if s.name == "kvd_background_errors_total"}
        assert counts == dict.fromkeys(("lease_expiry", "heartbeat", "reports", "reaper", "idle_peers"), 0.0), counts
