"""A relayout's copies: widened to the biggest element, cut for the copy
threads, and run on them, they write exactly what one ``copy_`` writes."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.core.relayout import Copy, split_copies, widen
from kvd.transport.copy_threads import CopyThreads


def _case(seed: int, scatter: bool) -> tuple[torch.Tensor, Copy]:
    """A canonical-like 6-D destination, and a copy into a permuted, sliced
    view of it (or a scatter of blocks along dim 2)."""
    rnd = random.Random(seed)
    shape = [rnd.randint(1, 3), rnd.randint(1, 2), rnd.randint(2, 9), rnd.randint(1, 5), rnd.randint(1, 4), rnd.choice([1, 3, 4, 8, 64])]
    dtype = rnd.choice([torch.int16, torch.bfloat16, torch.uint8, torch.int32])
    # The destination is a head slice of a permuted buffer: not contiguous.
    order = [0, 1, 2, 3, 4]
    rnd.shuffle(order)
    buffer = torch.zeros([shape[i] for i in order] + [shape[5]], dtype=dtype).permute([order.index(i) for i in range(5)] + [5])
    h0 = rnd.randint(0, shape[4] - 1)
    dst = buffer[:, :, :, :, h0:]
    src_shape = list(dst.shape)
    index = None
    if scatter:
        n = rnd.randint(1, shape[2])
        index = torch.tensor(rnd.sample(range(shape[2]), n))
        src_shape[2] = n
    src = (torch.randint(1, 100, src_shape, dtype=torch.int32)).to(dtype)
    return buffer, Copy(dst, src, index)


def _reference(buffer: torch.Tensor, c: Copy) -> torch.Tensor:
    out = buffer.clone()
    dst = out.as_strided(c.dst.shape, c.dst.stride(), c.dst.storage_offset())
    if c.index is None:
        dst.copy_(c.src)
    else:
        dst[:, :, c.index] = c.src
    return out


@settings(deadline=None, max_examples=60)
@given(st.integers(0, 2**32), st.booleans(), st.integers(1, 4), st.sampled_from([1, 64, 1 << 20]))
def test_widened_cut_copies_on_threads_write_what_one_copy_writes(seed, scatter, threads, min_bytes):
    buffer, c = _case(seed, scatter)
    want = _reference(buffer, c)
    pool = CopyThreads(threads, min_bytes)
    try:
        pool.run_copies([Copy(*widen(c.dst, c.src), c.index)])
    finally:
        pool.close()
    assert torch.equal(buffer, want)


def test_a_cut_copy_missing_one_share_is_caught():
    """Negative control: the check above sees a share that was not run."""
    buffer, c = _case(7, False)
    c = Copy(c.dst, torch.ones_like(c.src))
    want = _reference(buffer, c)
    shares = split_copies([c], 2, 1)
    assert len(shares) == 2
    shares[1].run()
    assert not torch.equal(buffer, want)
    shares[0].run()
    assert torch.equal(buffer, want)


def test_widen_takes_the_widest_element_the_rows_allow():
    rows = torch.zeros(4, 8, 128, dtype=torch.bfloat16)  # 256-byte rows
    d, s = widen(rows.permute(1, 0, 2), rows.permute(1, 0, 2))
    assert d.dtype == s.dtype == torch.int64 and d.shape[-1] == 32
    odd = torch.zeros(4, 3, dtype=torch.int16)  # 6-byte rows: int16 stays
    assert widen(odd, odd)[0].dtype == torch.int16
    # 4-byte rows, but 6 bytes from one row to the next: no int32 view of them
    assert widen(odd[:, :2], odd[:, :2])[0].dtype == torch.int16
    strided = torch.zeros(4, 8, dtype=torch.int16)[:, ::2]  # inner dim not dense: left alone
    assert widen(strided, strided)[0].dtype == torch.int16


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_copy_threads_raise_a_failure_only_after_every_running_job_stopped(threads):
    """No job starts after a failure, and ``run`` returns only when the jobs
    already running have finished (they may be writing into our memory)."""
    pool = CopyThreads(threads, 1)
    started, finished = [], []
    gate = threading.Event()

    def slow() -> None:
        started.append(1)
        gate.wait(5)
        time.sleep(0.05)
        finished.append(1)

    def bad() -> None:
        gate.set()
        raise RuntimeError("copy failed")

    try:
        with pytest.raises(RuntimeError, match="copy failed"):
            pool.run([slow] * (threads - 1) + [bad] + [slow] * 5)
        # The ones running finished, and none started after the failure: the
        # jobs before it, and at most the one a drainer took as it failed.
        assert len(finished) == len(started) and threads - 1 <= len(started) <= threads, (started, finished)
    finally:
        pool.close()


def test_a_job_on_a_copy_thread_that_runs_jobs_runs_them_inline():
    pool = CopyThreads(2, 1)
    ran = []
    try:
        inner = [lambda: ran.append("inner")] * 3
        pool.run([lambda: pool.run(inner), lambda: pool.run(inner)])  # one of them runs on the helper
        assert ran == ["inner"] * 6
    finally:
        pool.close()


def test_copy_threads_closed_run_everything_on_the_caller():
    pool = CopyThreads(2, 1)
    pool.close()
    ran = []
    pool.run([lambda: ran.append(1)] * 4)
    assert ran == [1] * 4


def test_submitted_batches_land_while_the_caller_goes_on_and_report_once_done():
    """``submit`` returns before its jobs have run; ``on_done`` runs once,
    after the last of them, with no failure; batches from several threads at
    once all finish, each its own bytes."""
    pool = CopyThreads(2, 1)
    gate = threading.Event()
    done: list[int] = []
    try:
        held = pool.submit([lambda: gate.wait(5)] * 3, lambda b: done.append(len(done)))
        assert not held.done and not done  # the caller went on
        gate.set()
        held.wait(help=False)
        assert held.done and held.failure is None and done == [0] and held.seconds > 0

        dsts = [torch.zeros(64, 1024, dtype=torch.int64) for _ in range(4)]
        srcs = [torch.arange(64 * 1024, dtype=torch.int64).view(1024, 64).t() + k for k in range(4)]  # transposing copies

        def feed(k: int) -> None:
            batches = [pool.submit_copies([Copy(dsts[k][i:i + 8], srcs[k][i:i + 8])]) for i in range(0, 64, 8)]
            for b in batches:
                b.wait(help=False)

        feeders = [threading.Thread(target=feed, args=(k,)) for k in range(4)]
        for t in feeders:
            t.start()
        for t in feeders:
            t.join(10)
        for k in range(4):
            assert torch.equal(dsts[k], srcs[k])
    finally:
        gate.set()
        pool.close()


def test_a_failed_or_cancelled_batch_raises_and_starts_nothing_after_it():
    pool = CopyThreads(2, 1)
    seen: list[BaseException | None] = []
    try:
        def bad() -> None:
            raise RuntimeError("copy failed")

        ran: list[int] = []
        batch = pool.submit([bad] + [lambda: ran.append(1)] * 50, lambda b: seen.append(b.failure))
        with pytest.raises(RuntimeError, match="copy failed"):
            batch.wait(help=False)
        assert len(ran) < 50 and isinstance(seen[0], RuntimeError)

        # A reader abandoned: its queued copies write nothing.
        cancel = threading.Event()
        cancel.set()
        dst, src = torch.zeros(1 << 20, dtype=torch.uint8), torch.ones(1 << 20, dtype=torch.uint8)
        with pytest.raises(ConnectionAbortedError):
            pool.submit_copies([Copy(dst, src)], cancel=cancel).wait(help=False)
        assert int(dst.sum()) == 0
        # Without it, the same copy lands (the control).
        pool.submit_copies([Copy(dst, src)]).wait(help=False)
        assert int(dst.sum()) == 1 << 20
    finally:
        pool.close()


def test_closing_copy_threads_finishes_what_is_queued_and_runs_later_work_inline():
    pool = CopyThreads(2, 1)
    gate = threading.Event()
    ran: list[str] = []
    queued = pool.submit([lambda: gate.wait(5), lambda: gate.wait(5), lambda: ran.append("queued")])
    pool.close()
    gate.set()
    queued.wait(help=False)
    later = pool.submit([lambda: ran.append("later")])
    assert later.done and ran == ["queued", "later"]
