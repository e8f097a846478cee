"""Calls an engine step makes of its daemon from inside a forward, run off
the forward's thread once the device has got there."""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvd.errors import KvdError


class SavesLayers(Protocol):
    """What ``AfterDevice`` needs of its client (``KvdClient``)."""

    def layers_saved(self, request_ids: Sequence[str], layers_saved: int) -> None: ...


class AfterDevice:
    """Calls an engine step makes of the daemon from inside its forward,
    each run on this thread, in order, once the device has done what the
    step enqueued before it (a CUDA event recorded on the compute stream
    when the caches are on a GPU; at once on host caches), so the forward
    never waits on the daemon or the device. A streaming prefill says its
    layers saved (``saved``); a decode starts its loads after vLLM's zeroing
    of the blocks they land in (``run``)."""

    def __init__(self, client: SavesLayers, num_layers: int, *, cuda: bool = False) -> None:
        # cuda: the caches are on a GPU; each call waits for the compute stream to get there.
        self.client, self.num_layers, self.cuda = client, num_layers, cuda
        self.error: KvdError | None = None  # the last refused save, for the engine's log
        self._queue: queue.SimpleQueue[tuple[Callable[[], None], Any] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvd-after-device", daemon=True)
        self._thread.start()

    def run(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once the current stream has reached this point."""
        event = None
        if self.cuda:
            import torch

            event = torch.cuda.Event()
            event.record()
        self._queue.put((fn, event))

    def saved(self, names: Sequence[str], layers_saved: int) -> None:
        """Every layer below ``layers_saved`` of ``names`` is written, or (on
        a GPU) will be once the current stream reaches this point."""
        self.run(functools.partial(self._say_saved, list(names), layers_saved))

    def _say_saved(self, names: list[str], upto: int) -> None:
        try:
            self.client.layers_saved(names, upto)
        except KvdError as e:  # an earlier save was refused; its read fails at layer_wait_seconds
            self.error = e

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, event = item
            if event is not None:
                event.synchronize()
            fn()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
