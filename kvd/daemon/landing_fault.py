"""A fault in what a pull landed, for tests only: the relayout bug that
verification must catch.

With ``KVD_TEST_LANDING_FAULT=swap_heads`` in its environment, a reading
daemon swaps local heads 0 and 1 of every block each pull landed, once the
bytes are in and before any check: what a relayout that put two heads in each
other's place would leave. Every byte still arrives; only where it lands is
wrong, which no check of the wire can see. Never set in production: the
daemon warns at startup when it is.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

from kvd.core.errors import InvalidArgument
from kvd.core.relayout import GroupTensors
from kvd.core.requests import Blocks

log = logging.getLogger("kvd.daemon")

ENV = "KVD_TEST_LANDING_FAULT"
FAULTS = ("swap_heads",)


def from_env() -> str:
    """The fault asked for in the environment, "" for none (a bad name is refused by name)."""
    fault = os.environ.get(ENV, "")
    if fault and fault not in FAULTS:
        raise InvalidArgument(ENV, fault, f"must be one of {', '.join(FAULTS)} (a test-only fault), or unset")
    if fault:
        log.warning("%s=%s: every pull's landed blocks are altered on purpose (a test-only fault)", ENV, fault)
    return fault


def after_landing(fault: str, groups: Sequence[GroupTensors], landed: Sequence[Blocks]) -> None:
    """What a pull landed, as ``fault`` (from ``from_env``) leaves it: as it is without one."""
    if fault == "swap_heads":
        swap_heads(groups, landed)


def swap_heads(groups: Sequence[GroupTensors], landed: Sequence[Blocks]) -> None:
    """Swap local heads 0 and 1 of ``landed``'s blocks, every layer and
    plane, in each group of tokens with two heads or more (a state part's
    rows are not heads of tokens; it is left alone)."""
    for group, blocks in zip(groups, landed, strict=False):
        if group.spec.state or group.spec.opaque or group.spec.num_kv_heads < 2 or not blocks.ids:
            continue
        ids = torch.tensor(list(blocks.ids), dtype=torch.int64)
        for view in group.parts:
            for li in range(len(group.layer_indices)):
                layer = view[li] if isinstance(view, torch.Tensor) else view[li][0]
                for plane in layer:  # (block, token, head, dim)
                    ids_here = ids.to(plane.device)
                    first = plane[ids_here, :, 0].clone()
                    plane[ids_here, :, 0] = plane[ids_here, :, 1]
                    plane[ids_here, :, 1] = first
