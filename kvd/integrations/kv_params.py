"""vLLM's ``kv_transfer_params`` as kvd reads and writes them (pure).

P's scheduler makes the params in ``request_finished``, before any worker has
published the blocks: it picks the capability itself and leaves the
generation to be resolved by D's daemon (``Peer.Resolve``). The keys follow
NixlConnector's, so proxies written for NIXL route kvd requests unchanged; the
kvd-specific ones are prefixed ``kvd_``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvd.core.errors import InvalidArgument
from kvd.proto import kvd_pb2 as pb

BlockIds = tuple[tuple[int, ...], ...]  # per KV cache group


@dataclass(frozen=True)
class Publication:
    """What P's worker publishes for one finished prefill."""

    request_id: str
    block_ids: BlockIds
    num_tokens: int
    capability: bytes
    lease_seconds: float


@dataclass(frozen=True)
class LoadRequest:
    """What D's worker pulls for one request: its own blocks, P's params."""

    request_id: str
    local_block_ids: BlockIds
    params: pb.TransferParams


def make_params(pub: Publication, *, engine_id: str, address: str, tp_size: int, pp_size: int, block_size: int) -> dict[str, Any]:
    """The JSON-safe dict P returns from ``request_finished``."""
    host, _, port = address.rpartition(":")
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": pub.request_id,
        "remote_block_ids": [list(g) for g in pub.block_ids],
        "remote_host": host,
        "remote_port": int(port),
        "tp_size": tp_size,
        "pp_size": pp_size,
        "remote_num_tokens": pub.num_tokens,
        "remote_block_size": block_size,
        "kvd_capability": pub.capability.hex(),
        "kvd_lease_seconds": pub.lease_seconds,
    }


def is_kvd_load(params: Mapping[str, Any] | None) -> bool:
    return params is not None and bool(params.get("do_remote_prefill")) and "kvd_capability" in params


def release_params(params: Mapping[str, Any]) -> pb.TransferParams:
    """What D's daemon needs to tell P it will not read a publication."""
    check_params(params)
    return pb.TransferParams(remote_engine_id=str(params["remote_engine_id"]), request_id=str(params["remote_request_id"]),
                             remote_address=f"{params['remote_host']}:{int(params['remote_port'])}",
                             capability=bytes.fromhex(str(params["kvd_capability"])))


def check_params(params: Mapping[str, Any]) -> None:
    """Raise InvalidArgument naming what makes ``params`` unusable (no side effects)."""
    groups = params.get("remote_block_ids")
    if not isinstance(groups, list) or not groups:
        raise InvalidArgument("remote_block_ids", groups, "must be a non-empty list of per-group block id lists")
    load_request("check", params, [[0] * max(1, len(g)) for g in groups], int(params.get("remote_block_size", 1) or 1))


def load_request(request_id: str, params: Mapping[str, Any], local_block_ids: Sequence[Sequence[int]], block_size: int, *,
                 hit_tokens: int | None = None) -> LoadRequest:
    """D's pull for ``params``: the prompt from token ``hit_tokens`` on, read
    from P's blocks into D's newly allocated ones (block sizes may differ).

    D may already hold a prefix of the prompt in its own prefix cache
    (``hit_tokens``, a multiple of D's block size); it allocates blocks only
    for the rest, and reads P's blocks from there (NixlConnector does the
    same). Without ``hit_tokens``, D's blocks pair with the tail of P's,
    which needs one block size on both sides.
    """
    try:
        remote = [list(map(int, g)) for g in params["remote_block_ids"]]
        num_tokens = int(params["remote_num_tokens"])
        remote_block_size = int(params.get("remote_block_size", block_size))
        capability = bytes.fromhex(str(params["kvd_capability"]))
        address = f"{params['remote_host']}:{int(params['remote_port'])}"
        engine_id, request_id = str(params["remote_engine_id"]), str(params["remote_request_id"])
    except KeyError as e:
        raise InvalidArgument("kv_transfer_params", sorted(params), f"lacks {e.args[0]!r}") from None
    except ValueError as e:
        raise InvalidArgument("kv_transfer_params", dict(params), f"has a malformed value: {e}") from None
    if len(remote) != len(local_block_ids):
        raise InvalidArgument("remote_block_ids", f"<{len(remote)} groups>", f"must match the {len(local_block_ids)} local KV cache groups")
    if remote_block_size <= 0:
        raise InvalidArgument("remote_block_size", remote_block_size, "must be positive")
    if hit_tokens is None:
        if remote_block_size != block_size:
            raise InvalidArgument("hit_tokens", None, f"must be given when block sizes differ (local {block_size}, remote {remote_block_size})")
        hit_tokens = max(0, len(remote[0]) - len(local_block_ids[0])) * block_size if remote else 0
    if hit_tokens % remote_block_size:
        raise InvalidArgument("hit_tokens", hit_tokens, f"ends inside a remote block of {remote_block_size} tokens")
    tokens = num_tokens - hit_tokens
    if tokens <= 0:
        raise InvalidArgument("remote_num_tokens", num_tokens, f"leaves nothing after the {hit_tokens} tokens D already holds")
    skip, need = hit_tokens // remote_block_size, -(-tokens // block_size)
    local: list[list[int]] = []
    trimmed_remote: list[list[int]] = []
    for g, (r, l_ids) in enumerate(zip(remote, local_block_ids, strict=True)):
        if not l_ids:
            raise InvalidArgument(f"local_block_ids[{g}]", [], "is empty: nothing to load")
        local.append(list(l_ids)[:need])  # blocks allocated past the prompt hold nothing of P's
        trimmed_remote.append(r[skip:])
    tp = pb.TransferParams(
        remote_engine_id=engine_id, remote_address=address, request_id=request_id, capability=capability,
        block_ids=[pb.BlockIds(ids=ids) for ids in trimmed_remote], num_tokens=tokens,
        remote_tp_size=int(params.get("tp_size", 1)), remote_pp_size=int(params.get("pp_size", 1)),
        lease_seconds=float(params.get("kvd_lease_seconds", 0.0)),
    )
    return LoadRequest(request_id, tuple(tuple(g) for g in local), tp)
