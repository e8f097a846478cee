from kvd.core.aggregate import KVOutputAggregator, Outcome, ReportLedger, WorkerFinished


def out(sending=(), recving=(), invalid=(), outcome="done"):
    w = WorkerFinished()
    for r in sending:
        w.add(Outcome(r, "sending", outcome))
    for r in recving:
        w.add(Outcome(r, "recving", outcome), invalid)
    return w


def test_request_finishes_once_every_worker_reported():
    agg = KVOutputAggregator(expected_finished_count=2)
    first = agg.aggregate([out(recving=["a", "b"])])
    assert first.recving == {}
    second = agg.aggregate([out(recving=["a"])])
    assert set(second.recving) == {"a"}
    third = agg.aggregate([out(recving=["b"])])
    assert set(third.recving) == {"b"}


def test_invalid_blocks_union_and_worst_outcome_wins():
    agg = KVOutputAggregator(2)
    merged = agg.aggregate([out(recving=["a"], invalid=[1, 2], outcome="failed"), out(recving=["a"], invalid=[2, 3])])
    assert merged.invalid_block_ids == {1, 2, 3}
    assert merged.recving["a"].outcome == "failed"


def test_drain_empties_the_box():
    w = out(sending=["x"])
    assert set(w.drain().sending) == {"x"}
    assert w.drain().sending == {}


def test_box_wakes_its_watchers_who_are_not_part_of_its_value():
    w = WorkerFinished()
    woken = []
    w.watchers.append(lambda: woken.append(1))
    w.add(Outcome("a", "recving", "failed"), [3])
    assert woken == [1]
    assert w == out(recving=["a"], invalid=[3], outcome="failed")


def test_push_log_resends_what_followed_or_says_it_cannot():
    from kvd.core.aggregate import PushLog

    log = PushLog(keep=3)
    assert log.since(0) == [] and log.since(1) is None  # 1 was never pushed
    pushed = [out(recving=[str(i)]) for i in range(5)]
    assert [log.push(x) for x in pushed] == [1, 2, 3, 4, 5]
    assert log.since(5) == [] and log.since(3) == [(4, pushed[3]), (5, pushed[4])]
    assert log.since(2) == [(3, pushed[2]), (4, pushed[3]), (5, pushed[4])]
    assert log.since(1) is None  # 2 is no longer kept
    assert log.claim() == 1 and log.claim() == 2 and log.owner == 2


def test_engine_hub_pushes_merged_sets_to_subscribers_or_keeps_them_for_drain():
    from kvd.core.aggregate import EngineFinishedHub

    hub = EngineFinishedHub(expected_finished_count=2)
    pushed = []
    hub.subscribers.append(pushed.append)
    hub.report(out(recving=["a"]))
    assert pushed == [] and hub.drain().recving == {}
    hub.report(out(recving=["a"], invalid=[4], outcome="failed"))
    assert [set(p.recving) for p in pushed] == [{"a"}] and pushed[0].invalid_block_ids == {4}
    # Pushed is delivered: kept as well, it would stay forever with nobody draining.
    assert hub.drain().recving == {}
    hub.subscribers.clear()
    hub.set_expected(1)
    hub.report(out(sending=["b"], invalid=[5]))
    drained = hub.drain()
    assert set(drained.sending) == {"b"} and len(pushed) == 1


def test_a_lower_expected_count_completes_what_already_has_that_many_reports():
    """The expected count can fall after reports came (vLLM's
    set_expected_finished_count once the engine starts, a rank's daemon
    coming back): a request with enough reports for the new count must
    complete then, as no report of it will come again."""
    from kvd.core.aggregate import EngineFinishedHub

    hub = EngineFinishedHub(expected_finished_count=2)
    pushed = []
    hub.subscribers.append(pushed.append)
    hub.report(out(recving=["a", "b"], outcome="failed"))
    hub.report(out(recving=["b"]))  # b: two of two, a: one of two
    assert [set(p.recving) for p in pushed] == [{"b"}]
    merged = hub.set_expected(1)
    assert set(merged.recving) == {"a"} and merged.recving["a"].outcome == "failed"  # its worst outcome so far
    assert [set(p.recving) for p in pushed] == [{"b"}, {"a"}]
    assert hub.set_expected(2).empty and len(pushed) == 2  # a higher count completes nothing
    hub.report(out(recving=["c"]))
    assert len(pushed) == 2 and set(hub.set_expected(1).recving) == {"c"}
    # Another engine (another world) is not handed what the old one left half-reported.
    hub.set_expected(2)
    hub.report(out(recving=["d"]))
    hub.new_engine(1)
    assert len(pushed) == 3 and hub.expected == 1
    hub.report(out(recving=["e"]))
    assert [set(p.recving) for p in pushed[3:]] == [{"e"}]


def test_a_box_nobody_reads_stays_bounded_and_forgets_the_oldest():
    from kvd.core.aggregate import MAX_UNREAD, EngineFinishedHub

    box = out(recving=[f"r{i}" for i in range(10)], sending=["s"])
    assert box.bound(limit=4) == 6
    assert list(box.recving) == ["r6", "r7", "r8", "r9"] and set(box.sending) == {"s"}
    assert box.bound(limit=4) == 0  # within the bound: nothing goes
    hub = EngineFinishedHub()
    for i in range(MAX_UNREAD + 10):
        hub.report(out(recving=[f"q{i}"]))
    assert len(hub.pending.recving) == MAX_UNREAD and hub.dropped == 10
    assert "q9" not in hub.pending.recving and f"q{MAX_UNREAD + 9}" in hub.pending.recving


def test_extend_appends_a_later_box_after_this_ones_outcomes():
    first, later = WorkerFinished(), WorkerFinished()
    first.add(Outcome("a", "recving", "done"), [1])
    first.add(Outcome("b", "sending", "done"))
    later.add(Outcome("c", "recving", "failed"), [2])
    later.add(Outcome("a", "recving", "failed"))  # a later word on a replaces the earlier one
    first.extend(later)
    assert [o.request_id for o in first.outcomes()] == ["b", "a", "c"]
    assert first.recving["a"].outcome == "failed" and first.invalid_block_ids == {1, 2}
    first.bound(limit=1)  # the oldest of each direction go first
    assert list(first.recving) == ["c"] and list(first.sending) == ["b"]


def test_take_moves_out_the_oldest_outcomes_and_every_invalid_id():
    box = WorkerFinished()
    for i in range(3):
        box.add(Outcome(f"s{i}", "sending", "done"))
        box.add(Outcome(f"r{i}", "recving", "failed"), [i])
    first = box.take(4)
    assert [o.request_id for o in first.outcomes()] == ["s0", "s1", "s2", "r0"] and first.invalid_block_ids == {0, 1, 2}
    assert [o.request_id for o in box.outcomes()] == ["r1", "r2"] and not box.invalid_block_ids
    assert [o.request_id for o in box.take(10).outcomes()] == ["r1", "r2"] and not box.outcomes()


def test_the_ledger_applies_each_numbered_report_once_per_sender():
    ledger = ReportLedger(max_senders=2)
    repeats = 0

    def apply(sender: str, seq: int) -> bool:
        nonlocal repeats
        if ledger.applied(sender, seq):
            repeats += 1
            return False
        ledger.record(sender, seq)
        return True

    assert not ledger.applied("a", 1)  # not applied until recorded: one that failed halfway comes again
    assert apply("a", 1) and not apply("a", 1)  # sent again after a lost answer
    assert apply("a", 2) and not apply("a", 1)  # a late copy of an earlier one
    assert apply("b", 1)  # another daemon (or a restart: a new epoch) numbers from 1
    assert apply("", 0) and apply("", 0)  # unnumbered reports always apply
    assert repeats == 2
    apply("c", 1)  # past max_senders the oldest sender is forgotten
    assert apply("a", 2) and not apply("c", 1)


def test_a_bounded_box_forgets_outcomes_never_invalid_block_ids():
    """Past the bound the oldest outcomes go, but every invalid block id
    stays (they are bounded by the engine's blocks): a failed load read with
    only some of its invalid ids would have vLLM take unwritten blocks for
    loaded. The control, before: ids past the bound were dropped at random."""
    box = out(recving=[f"r{i}" for i in range(10)])
    box.invalid_block_ids |= set(range(100))
    assert box.bound(limit=4) == 6
    assert len(box.recving) == 4 and box.invalid_block_ids == set(range(100))


def test_a_full_box_is_taken_in_batches_oldest_first_and_bounded_to_its_newest():
    """A box of 65,536 outcomes a direction (nobody read it) taken 4096 at a
    time: batches of the oldest, sending first, until it is empty; a box
    past the bound keeps its newest. (Each batch now lists its keys once:
    popping the first key again and again was quadratic, up to 350 ms a
    batch on the event loop; the cost is measured outside the tests.)"""
    from kvd.core.aggregate import MAX_UNREAD

    box = out(recving=[f"r{i}" for i in range(MAX_UNREAD)], sending=[f"s{i}" for i in range(MAX_UNREAD)])
    batches = []
    while not (batch := box.take(4096)).empty:
        batches.append(batch)
    assert [len(b.sending) + len(b.recving) for b in batches] == [4096] * 32 and box.empty
    assert next(iter(batches[0].sending)) == "s0" and next(iter(batches[16].recving)) == "r0" and list(batches[-1].recving)[-1] == f"r{MAX_UNREAD - 1}"
    box = out(recving=[f"r{i}" for i in range(2 * MAX_UNREAD)])
    assert box.bound() == MAX_UNREAD and next(iter(box.recving)) == f"r{MAX_UNREAD}" and len(box.recving) == MAX_UNREAD
