"""A daemon's background loops outlive their own failures (``keep_running``):
a loop that raised is logged with its traceback, counted, and started again."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvd.daemon.background import keep_running


def test_a_loop_that_raises_is_logged_counted_and_started_again(caplog):
    """The loop fails on its first two runs and then ticks: the runner
    restarts it each time, counts each failure by the loop's name and logs
    it with the traceback. The control: the same loop as a bare task (as the
    daemon ran them) dies on its first failure and never ticks."""
    def make_loop(ticks: list[int], runs: list[int]):
        async def loop() -> None:
            runs.append(1)
            if len(runs) <= 2:
                raise OSError(f"run {len(runs)} failed")
            while True:
                ticks.append(1)
                await asyncio.sleep(0.01)
        return loop

    async def scenario() -> tuple[list[int], list[int], list[str], list[int], bool]:
        ticks: list[int] = []
        runs: list[int] = []
        errors: list[str] = []
        task = asyncio.create_task(keep_running("reaper", make_loop(ticks, runs), errors.append, pause=0.01))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        bare_ticks: list[int] = []
        bare = asyncio.create_task(make_loop(bare_ticks, [])())
        await asyncio.sleep(0.1)
        return ticks, runs, errors, bare_ticks, bare.done() and isinstance(bare.exception(), OSError)

    with caplog.at_level(logging.ERROR, logger="kvd.daemon"):
        ticks, runs, errors, bare_ticks, bare_died = asyncio.run(scenario())
    assert len(runs) == 3 and errors == ["reaper", "reaper"] and len(ticks) > 5, (runs, errors, ticks)
    failed = [r for r in caplog.records if "background loop 'reaper' failed" in r.getMessage()]
    assert len(failed) == 2 and all(r.exc_info and "run" in str(r.exc_info[1]) for r in failed)
    assert bare_died and not bare_ticks  # the control
