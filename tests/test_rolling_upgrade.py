"""A rolling upgrade of a P/D fleet under load (``pytest -m upgrade``).

Two prefill and two decode daemons, all on the previous release (found
through CHANGELOG.md, checked out from git), each with a worker, carry a
steady load: one request after another, from each prefill to each decode in
turn, every landed block checked. Each daemon in turn is drained with SIGTERM
and replaced on its port by this tree; its worker registers again with the
new daemon, as the vLLM connector does. The fleet runs mixed versions in
both roles for most of the test.

Each request ends one of these ways, and the test counts them per phase:
- done, every byte checked;
- refused early (the daemon was draining or gone when it was published or
  pulled), or failed with its invalid blocks, or in flight on a decode daemon
  that exited (its worker's feed says so): the engine recomputes it;
- never lost: no request waits forever, and none lands wrong bytes.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from dataclasses import dataclass, field

import pytest

import kvd
from kvd.client import FinishedFeed, daemon_status
from kvd.errors import DeadlineExceeded, KvdError
from tests.conftest import DaemonProc, Daemons, TestWorker, free_port, make_worker, wait_for
from tests.release_support import previous_release

pytestmark = [pytest.mark.upgrade, pytest.mark.slow, pytest.mark.timeout(900)]

BLOCKS = 6  # per request: 6 blocks of 16 tokens, 4 layers


@dataclass
class Node:
    """A daemon on a fixed port and the worker beside it (its feed, on decode)."""

    role: str
    port: int
    daemon: DaemonProc
    worker: TestWorker
    feed: FinishedFeed | None = None
    rejoins: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def rejoin(self, within: float = 60) -> None:
        """Register again with whatever daemon now answers on the port."""
        t0 = time.monotonic()
        while True:
            with contextlib.suppress(KvdError):
                if not daemon_status(self.address, timeout=2).draining:  # not the old one, on its way out
                    self.worker.register()
                    break
            assert time.monotonic() - t0 < within, f"{self.role} worker could not register again within {within}s"
            time.sleep(0.2)
        if self.role == "decode":
            if self.feed is not None:
                self.feed.close()
            self.feed = FinishedFeed(self.worker.client).start()
            assert self.feed.subscribed.wait(30)
        self.rejoins += 1


@dataclass
class Tally:
    rows: dict[str, dict[str, int]] = field(default_factory=dict)
    why: dict[str, list[str]] = field(default_factory=dict)  # each phase's first reasons for a recompute

    def count(self, phase: str, what: str, why: str) -> None:
        row = self.rows.setdefault(phase, dict.fromkeys(("requests", "done", "recomputed", "wrong", "lost"), 0))
        row["requests"] += 1
        row[what] += 1
        if why and len(reasons := self.why.setdefault(phase, [])) < 3:
            reasons.append(why)


def _request(i: int, p: Node, d: Node) -> tuple[str, str]:
    """One request from p to d; what became of it, and why if not done."""
    rid, seed = f"r{i}", 1000 + i
    ids = [1 + (i % 8) * BLOCKS + k for k in range(BLOCKS)]
    p.worker.fill(seed, ids)
    d.worker.fill(seed + 7, ids)  # what D held before: a block that did not land keeps it
    try:
        params = p.worker.client.publish(rid, [ids], BLOCKS * 16)
    except KvdError as e:  # P draining or gone: the engine recomputes (P registers again once its daemon answers)
        p.rejoin()
        return "recomputed", f"publish on {p.worker.worker.engine_id}: {e}"
    assert d.feed is not None
    try:
        d.worker.client.pull(rid, params, [ids])
    except KvdError as e:
        d.rejoin()
        return "recomputed", f"pull on {d.worker.worker.engine_id}: {e}"
    try:
        f = d.feed.wait_finished(recving={rid}, timeout=60)
    except DeadlineExceeded:
        return "lost", "no outcome within 60 s"  # the feed is healthy and the outcome never came
    except KvdError as e:  # D's daemon exited with the pull in flight: the connector fails it, vLLM recomputes
        d.rejoin()
        return "recomputed", f"{d.worker.worker.engine_id}'s feed ended: {e}"
    detail = f.details[("recving", rid)]
    invalid = {b for b in f.invalid_block_ids if b in set(ids)}
    if detail.outcome == "done":
        return ("done", "") if not invalid and d.worker.mismatch(seed, ids, BLOCKS * 16) is None else ("wrong", "done, but not these bytes")
    # Failed: exactly the blocks called invalid did not land; the rest hold the request's bytes.
    if not invalid:
        return "wrong", f"failed with no invalid blocks: {detail.reason}"
    d.worker.fill(seed, [b if b in invalid else 0 for b in ids])
    exact = d.worker.mismatch(seed, ids, BLOCKS * 16) is None
    return ("recomputed", f"failed, {len(invalid)} blocks invalid: {detail.reason}") if exact else ("wrong", "a block not called invalid did not land")


def _load(nodes: dict[str, list[Node]], phase: list[str], tally: Tally, stop: threading.Event, errors: list[BaseException]) -> None:
    i = 0
    try:
        while not stop.is_set():
            p, d = nodes["prefill"][i % 2], nodes["decode"][(i // 2) % 2]
            label = phase[0]
            tally.count(label, *_request(i, p, d))
            i += 1
    except BaseException as e:  # the test thread asserts on it
        errors.append(e)


def test_two_prefill_and_two_decode_daemons_upgraded_one_at_a_time_under_load(tmp_path, previous):
    version, tree = previous
    assert previous_release()[0] == version != kvd.__version__
    ds = Daemons(tmp_path)
    nodes: dict[str, list[Node]] = {"prefill": [], "decode": []}
    try:
        for role in nodes:
            for k in range(2):
                port = free_port()
                daemon = ds.start(f"{role}-{k}", grpc_port=port, source=tree)
                assert daemon_status(daemon.grpc).version == version
                node = Node(role, port, daemon, make_worker(f"127.0.0.1:{port}", f"{role}-{k}", num_blocks=64))
                if role == "decode":
                    node.feed = FinishedFeed(node.worker.client).start()
                    assert node.feed.subscribed.wait(30)
                nodes[role].append(node)
        tally, phase, stop, errors = Tally(), [f"all on {version}"], threading.Event(), []
        loader = threading.Thread(target=_load, args=(nodes, phase, tally, stop, errors), daemon=True)
        loader.start()
        time.sleep(6)
        for node in (nodes["prefill"][0], nodes["decode"][0], nodes["prefill"][1], nodes["decode"][1]):
            name = f"{node.role}-{node.daemon.engine_id[-1]}"
            phase[0] = f"{name} draining and replaced"
            rejoins = node.rejoins
            assert node.daemon.stop(signal.SIGTERM) == 0, node.daemon.log()[-2000:]  # drains, then exits 0
            node.daemon = ds.start(node.daemon.engine_id, grpc_port=node.port)
            assert daemon_status(node.daemon.grpc).version == kvd.__version__
            # Its worker notices on its next request and registers again.
            wait_for(lambda n=node, r=rejoins: n.rejoins > r or bool(errors), 90, f"{name}'s worker did not register again")
            phase[0] = f"{name} on {kvd.__version__}"
            wait_for(lambda: tally.rows.get(phase[0], {}).get("done", 0) >= 40 or bool(errors), 120,
                      f"fewer than 40 requests done in phase {phase[0]}: {tally.rows}")
            assert not errors, errors
        stop.set()
        loader.join(timeout=120)
        assert not errors, errors
    finally:
        stop_all = [n.feed for ns in nodes.values() for n in ns if n.feed is not None]
        for feed in stop_all:
            feed.close()
        ds.kill_all()
    print("\n" + "\n".join(f"{k}: {v} {tally.why.get(k, '')}" for k, v in tally.rows.items()))
    totals = {k: sum(r[k] for r in tally.rows.values()) for k in ("requests", "done", "recomputed", "wrong", "lost")}
    assert totals["wrong"] == 0 and totals["lost"] == 0, tally.rows
    # Every phase after a replacement moved requests through the new daemon, beside the old ones.
    assert all(r["done"] >= 40 for k, r in tally.rows.items() if k.endswith(kvd.__version__)), tally.rows
    assert totals["recomputed"] <= totals["requests"] // 4, tally.rows
