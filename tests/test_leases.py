import numpy as np
import pytest

from kvd.core.errors import Aborted, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from kvd.core.leases import LayersAdvanced, PublicationTable, check_unique


def table():
    return PublicationTable(default_lease_s=10, epoch="e")


def test_publish_authorize_ack_ends_publication():
    t = table()
    pub = t.publish((0, 0), "r1", [[1, 2, 3]], [8], 48, now=0)
    assert t.authorize("r1", pub.generation, pub.capability, "D", (0, 0), now=1) is pub
    t.check_blocks(pub, (0, 0), 0, 1, 3)
    ended = t.ack("r1", pub.generation, (0, 0), ("D", 0, 0), expected=1)
    assert [(e.request_id, e.outcome) for e in ended] == [("r1", "done")]
    with pytest.raises(Aborted, match="ended before this read: done"):
        t.authorize("r1", pub.generation, pub.capability, "D", (0, 0), now=2)


def test_wrong_capability_generation_reader_expiry_and_blocks_are_refused():
    t = table()
    pub = t.publish((0, 0), "r1", [[1, 2]], [8], 32, now=0, reader_engine_id="D")
    with pytest.raises(PermissionDenied, match="capability"):
        t.authorize("r1", pub.generation, b"x" * 32, "D", (0, 0), now=1)
    with pytest.raises(PermissionDenied, match="stale"):
        t.authorize("r1", pub.generation + 1, pub.capability, "D", (0, 0), now=1)
    with pytest.raises(PermissionDenied, match="only be read by"):
        t.authorize("r1", pub.generation, pub.capability, "E", (0, 0), now=1)
    with pytest.raises(NotFound):
        t.authorize("r1", pub.generation, pub.capability, "D", (1, 0), now=1)
    with pytest.raises(PermissionDenied, match="not all published"):
        t.check_blocks(pub, (0, 0), 0, 2, 2)
    with pytest.raises(PermissionDenied, match="expired"):
        t.authorize("r1", pub.generation, pub.capability, "D", (0, 0), now=11)


def test_expiry_reports_every_rank_once():
    t = table()
    t.publish((0, 0), "r", [[1]], [4], 1, now=0)
    t.publish((1, 0), "r", [[1]], [4], 1, now=0)
    ended = t.expire(now=10)
    assert sorted(e.rank for e in ended) == [(0, 0), (1, 0)]
    assert all(e.outcome == "expired" for e in ended)
    assert t.expire(now=20) == [] and len(t) == 0


def test_reused_block_id_gets_a_new_generation():
    t = table()
    old = t.publish((0, 0), "a", [[5]], [8], 16, now=0)
    t.abort("a")
    new = t.publish((0, 0), "b", [[5]], [8], 16, now=1)
    assert new.generation > old.generation
    with pytest.raises(Aborted, match="'a' ended before this read: aborted"):
        t.authorize("a", old.generation, old.capability, "D", (0, 0), now=1)


def test_a_read_of_an_ended_publication_hears_why_and_only_with_its_capability():
    """A striped read's late stripe, after an abort, is told the publication
    ended and how; a wrong capability learns nothing, and the record lasts a lease."""
    t = table()
    pub = t.publish((0, 0), "r", [[1, 2]], [8], 32, now=0)
    t.abort("r", reason="the engine aborted it")
    with pytest.raises(Aborted, match=r"ended before this read: aborted \(the engine aborted it\)"):
        t.authorize("r", pub.generation, pub.capability, "D", (0, 0), now=1)
    with pytest.raises(PermissionDenied, match="matches this capability"):
        t.authorize("r", pub.generation, b"y" * 32, "D", (0, 0), now=1)
    t.check_not_ended("r", b"y" * 32, now=1)  # nothing to say to a stranger
    # The record is kept for a lease past the publication's own expiry (10 + 10).
    with pytest.raises(PermissionDenied, match="matches this capability"):
        t.authorize("r", pub.generation, pub.capability, "D", (0, 0), now=20)


def test_ranks_share_capability_and_bad_input_is_refused():
    t = table()
    a = t.publish((0, 0), "r", [[1]], [4], 1, now=0)
    b = t.publish((1, 0), "r", [[1]], [4], 1, now=0)
    assert a is b
    with pytest.raises(FailedPrecondition):
        t.publish((1, 0), "r", [[1]], [4], 1, now=0)
    with pytest.raises(InvalidArgument, match=r"block_ids\[0\]=9"):
        t.publish((0, 0), "q", [[9]], [4], 1, now=0)
    with pytest.raises(InvalidArgument, match="capability"):
        t.publish((0, 0), "q", [[1]], [4], 1, now=0, capability=b"short")


def test_ack_needs_every_expected_reader():
    t = table()
    pub = t.publish((0, 0), "r", [[1]], [4], 1, now=0)
    assert t.ack("r", pub.generation, (0, 0), ("D", 0, 0), expected=2) == []
    assert t.ack("r", pub.generation, (0, 0), ("D", 0, 0), expected=2) == []  # a repeat does not count twice
    assert len(t.ack("r", pub.generation, (0, 0), ("D", 1, 0), expected=2)) == 1


def test_renewal_extends_by_the_publications_own_lease():
    t = table()  # default 10 s
    pub = t.publish((0, 0), "r", [[1]], [4], 1, now=0, lease_s=600)
    assert t.renew("r", pub.generation, pub.capability, now=500)
    assert not t.renew("r", pub.generation, b"x" * 32, now=500)  # another capability renews nothing
    assert pub.expires_at == 1100  # 500 + 600, not 500 + the 10 s default


def test_a_striped_read_ends_the_rank_only_when_every_stripe_is_acked():
    t = table()
    pub = t.publish((0, 0), "r", [[1, 2, 3]], [8], 48, now=0)
    assert t.ack("r", pub.generation, (0, 0), ("D", 0, 0), 1, stripe=0, stripes=2) == []
    assert t.ack("r", pub.generation, (0, 0), ("D", 0, 0), 1, stripe=0, stripes=2) == []  # the same stripe twice
    ended = t.ack("r", pub.generation, (0, 0), ("D", 0, 0), 1, stripe=1, stripes=2)
    assert [(e.request_id, e.outcome) for e in ended] == [("r", "done")]


def test_readers_of_one_rank_that_cut_their_reads_differently_each_ack_all_of_theirs():
    """Two D ranks read one P rank, one in 3 stripes and one in 2 (they read
    different bytes of it: uneven pipeline stages, or reads cut by size):
    the rank ends when both ACKed all of theirs, not at 2 x whichever count
    ACKed last (which ended it a stripe early, or never)."""
    t = table()
    pub = t.publish((0, 0), "r", [[1, 2, 3]], [8], 48, now=0)
    a, b = ("D", 0, 0), ("D", 0, 1)
    for stripe in range(3):
        assert t.ack("r", pub.generation, (0, 0), a if stripe < 2 else b, 2, stripe=stripe % 2, stripes=3 if stripe < 2 else 2) == []
    assert t.ack("r", pub.generation, (0, 0), b, 2, stripe=1, stripes=2) == []  # b is whole; a has 2 of its 3: 4 ACKs of 5
    assert [e.outcome for e in t.ack("r", pub.generation, (0, 0), a, 2, stripe=2, stripes=3)] == ["done"]
    pub = t.publish((0, 0), "q", [[4]], [8], 16, now=0)
    for reader, stripes in ((a, 3), (b, 2)):  # a whole first: counted together, b's first ACK (4 of 2 x 2) ended it early
        for stripe in range(stripes - (reader == b)):
            assert t.ack("q", pub.generation, (0, 0), reader, 2, stripe=stripe, stripes=stripes) == []
    assert [e.outcome for e in t.ack("q", pub.generation, (0, 0), b, 2, stripe=1, stripes=2)] == ["done"]


def test_an_end_while_a_reader_copies_is_reported_when_the_last_pin_goes():
    """The engine reuses blocks once their end is reported, so an abort or an
    expiry while a same-host/NIXL reader copies is held until it is done, yet
    refuses new reads at once."""
    t = table()
    pub = t.publish((0, 0), "r1", [[1, 2]], [8], 32, now=0)
    a, b = t.pin(pub, (0, 0)), t.pin(pub, (0, 0))
    assert t.abort("r1") == [] and t.pinned == 1
    with pytest.raises(Aborted, match="ended before this read"):
        t.authorize("r1", pub.generation, pub.capability, "D", (0, 0), now=1)
    assert t.unpin(a) == []
    assert [(e.request_id, e.outcome) for e in t.unpin(b)] == [("r1", "aborted")]
    assert t.pinned == 0 and t.unpin(b) == []  # a second close reports nothing
    # A rank may not publish again into a generation whose end it still owes.
    other = t.publish((0, 0), "r3", [[1]], [8], 16, now=0)
    t.publish((1, 0), "r3", [[1]], [8], 16, now=0)
    held = t.pin(other, (0, 0))
    assert t.abort("r3", (0, 0)) == []
    with pytest.raises(FailedPrecondition, match="still being read"):
        t.publish((0, 0), "r3", [[1]], [8], 16, now=1)
    assert [e.rank for e in t.unpin(held)] == [(0, 0)]
    t.publish((0, 0), "r3", [[1]], [8], 16, now=1)
    assert sorted(e.rank for e in t.abort("r3")) == [(0, 0), (1, 0)]
    # Expiry is held the same way; a new generation of the same request is not.
    old = t.publish((0, 0), "r2", [[1]], [8], 16, now=0)
    pin = t.pin(old, (0, 0))
    assert t.expire(now=20) == []
    new = t.publish((0, 0), "r2", [[1]], [8], 16, now=20)
    assert new.generation != old.generation
    assert [e.outcome for e in t.abort("r2")] == ["aborted"]
    assert [e.outcome for e in t.unpin(pin)] == ["expired"]


def test_an_unpinned_read_then_ack_ends_the_rank_at_once():
    t = table()
    pub = t.publish((0, 0), "r1", [[1, 2]], [8], 32, now=0)
    assert t.unpin(t.pin(pub, (0, 0))) == []
    assert [e.outcome for e in t.ack("r1", pub.generation, (0, 0), ("D", 0, 0), expected=1)] == ["done"]


def test_ranks_of_one_publication_agree_on_its_tokens_and_each_group_holds_them():
    t = table()
    pub = t.publish((0, 0), "r", [[1, 2], [5, 6]], [8, 8], 60, now=0, block_sizes=[32, 16], first_tokens=[0, 32],
                    capability=b"c" * 32)
    assert pub.first_tokens == (0, 32)
    # Another rank that says its window group starts elsewhere would shift what a reader maps: refused by name.
    with pytest.raises(FailedPrecondition, match=r"tp1/pp0 publishes num_tokens=60 and first_tokens=\[0, 16\]"):
        t.publish((1, 0), "r", [[1, 2], [5, 6, 7]], [8, 8], 60, now=0, block_sizes=[32, 16], first_tokens=[0, 16], capability=b"c" * 32)
    t.publish((1, 0), "r", [[3, 4], [1, 2]], [8, 8], 60, now=0, block_sizes=[32, 16], first_tokens=[0, 32], capability=b"c" * 32)
    # A group's first token is a block boundary below num_tokens, and its blocks hold the rest.
    with pytest.raises(InvalidArgument, match=r"block_ids\[1\].first_token=8 must be a multiple of the block size 16"):
        t.publish((0, 0), "s", [[1, 2], [5, 6]], [8, 8], 60, now=0, block_sizes=[32, 16], first_tokens=[0, 8])
    with pytest.raises(InvalidArgument, match=r"block_ids\[1\]='<1 blocks>' of 16 tokens from token 32 cannot hold num_tokens=60"):
        t.publish((0, 0), "s", [[1, 2], [5]], [8, 8], 60, now=0, block_sizes=[32, 16], first_tokens=[0, 32])


def test_a_repeated_block_id_is_named_whether_ids_are_dense_or_sparse():
    """Dense ids (below a few times their count) are counted, sparse ones
    sorted: both name the smallest repeated id, and unique ids pass."""
    dense = np.random.default_rng(0).permutation(100_000)
    check_unique("ids", dense)
    for ids in (np.append(dense, [70_000, 5]), np.array([1 << 40, 7, 3, 1 << 40, 3])):
        with pytest.raises(InvalidArgument, match=r"ids=(5|3) is listed more than once"):
            check_unique("ids", ids)
    check_unique("ids", np.array([1 << 40, 7, 3]))
    check_unique("ids", np.array([4]))



def _owner_with_a_publication():
    """An owner holding a publication of blocks 1-8 of a one-rank engine's
    one group, and a reader that handshook."""
    import random

    from kvd.core.owner import Owner
    from kvd.core.spec import NAMED_LAYOUTS, KVCacheSpec, ModelInfo
    from kvd.testing.sim import make_engine

    def spec(_rank: int) -> KVCacheSpec:
        return KVCacheSpec(16, 2, 8, "bfloat16", NAMED_LAYOUTS["NHD"], 64)

    p = make_engine("P", 1, 1, ModelInfo(2, 2), spec, random.Random(0), fill=False)
    d = make_engine("D", 1, 1, ModelInfo(2, 2), spec, random.Random(1), fill=False)
    owner = Owner("P", "host", PublicationTable(60.0, "e"), same_host=False, max_segments_per_read=1024)
    tensors = [p.ranks[(0, 0)].tensors]
    pub, _ = owner.publish((0, 0), "r", [list(range(1, 9))], tensors, 8 * 16, 0.0, capability=b"c" * 32)
    return owner, owner.reader_joined(d.meta, 0.0), tensors, pub


def _batched_read(pub, segment_ids):
    """A read of one batched segment (both layers) per tuple of ``segment_ids``."""
    from kvd.core.reads import DataRead, DataSegment

    segments = tuple(DataSegment(group_id=0, layers=(0, 1), block_count=len(ids), token_count=16, block_ids=ids) for ids in segment_ids)
    return DataRead(owner_engine_id="P", request_id="r", generation=pub.generation, capability=pub.capability, tp_rank=0, pp_rank=0,
                    head_start=0, head_count=2, segments=segments)


def test_owner_checks_every_block_of_a_reads_batched_segments():
    owner, reader, tensors, pub = _owner_with_a_publication()
    read = _batched_read(pub, [(3, 1, 8), (2,), (7, 5)])
    assert owner.authorize(read, reader, tensors, 1.0).read is read
    # One unpublished block in any segment refuses the whole read, and is named.
    for bad, named in (([(3, 1, 8), (2, 9), (7, 5)], 9), ([(12,), (2,), (7, 5)], 12), ([(3, 1, 8), (2,), (7, 0)], 0)):
        with pytest.raises(PermissionDenied, match=rf"blocks \[{named}\] of group 0 are not published"):
            owner.authorize(_batched_read(pub, bad), reader, tensors, 1.0)
    with pytest.raises(InvalidArgument, match=r"segment\.block_ids"):
        owner.authorize(_batched_read(pub, [(3,), (64,)]), reader, tensors, 1.0)


def test_a_publication_is_released_once_no_reader_here_is_open_and_one_gave_up():
    """At once when every rank registered here has pulled it or will not;
    after the grace while one has not been seen (its Pull may be on its way)."""
    from kvd.core.reader_release import RELEASE_GRACE_SECONDS, ReaderRelease, publication
    from kvd.core.requests import TransferParams

    def params(rid: str, generation: int = 0) -> TransferParams:
        return TransferParams(remote_engine_id="prefill", remote_address="h:1", request_id=rid, capability=rid.encode(),
                              block_ids=(), num_tokens=16, generation=generation)

    r0, r1, r2 = (0, 0), (1, 0), (2, 0)
    tp2, tp3 = {r0, r1}, {r0, r1, r2}
    a, b = params("r1"), params("r2")
    readers = ReaderRelease()
    readers.started(a, r0)
    readers.started(a, r1)
    readers.started(b, r0)
    assert readers.ended(a, r0, tp3, "rank 0 failed") is None  # its sibling still reads
    assert readers.open_pulls(publication(a)) == 1 and readers.due(publication(a)) is None
    # The sibling (resolved) landed; rank 2 has not been seen: a release is due after the grace.
    assert readers.ended(params("r1", generation=3), r1, tp3) == RELEASE_GRACE_SECONDS
    readers.started(a, r2)  # the late sibling's Pull within the grace keeps the publication
    assert readers.due(publication(a)) is None
    assert readers.ended(a, r2, tp3) == 0.0  # every rank here seen: none can come, due now
    release = readers.due(publication(a))  # P hears the first reason, with the resolved params
    assert release is not None and release.reason == "rank 0 failed" and release.params.generation == 3
    assert readers.due(publication(a)) is None  # once
    assert readers.ended(b, r0, tp2) is None and readers.due(publication(b)) is None  # every reader landed: P ends it on their ACKs
    c = params("r3")
    assert readers.give_up(c, r0, tp2, "not needed") == RELEASE_GRACE_SECONDS  # rank 1 may still pull it
    assert readers.give_up(c, r1, tp2, "not needed") == 0.0  # it will not either
    release = readers.due(publication(c))
    assert release is not None and release.reason == "not needed"
    readers.started(a, r0)
    assert readers.give_up(a, r1, tp2, "refused") is None  # a sibling still reads: its end releases
    assert readers.ended(a, r0, tp2) == 0.0 and readers.due(publication(a)).reason == "refused"
    d = params("r4")  # a TP1 engine's only rank failed: nothing to wait for (the registry's keys, as the shell may pass)
    readers.started(d, r0)
    assert readers.ended(d, r0, {r0: "registration"}.keys(), "failed to load it") == 0.0


def test_layers_saved_out_of_order_moves_each_layer_once():
    """A worker's saves are sent without waiting and may arrive in any order:
    the watermark only rises, and each layer is counted once."""
    t = table()
    pub = t.publish((0, 0), "s", [[1, 2]], [8], 32, now=0, stream=True)
    t.publish((0, 0), "whole", [[3]], [8], 16, now=0)
    assert t.layers_saved((0, 0), ["s"], 5) == LayersAdvanced(publications=1, layers=5)
    assert t.layers_saved((0, 0), ["s"], 2) == LayersAdvanced(publications=0, layers=0)  # late
    assert t.saved_below("s", pub.generation, (0, 0), now=1) == 5
    # Not published here, published whole, already there: nothing moves.
    assert t.layers_saved((0, 0), ["gone", "whole", "s"], 5) == LayersAdvanced(publications=0, layers=0)
    assert t.layers_saved((0, 0), ["s"], 8) == LayersAdvanced(publications=1, layers=3)
