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

from kvd.core.addresses import host_port, split_host_port
from kvd.core.errors import InvalidArgument
from kvd.core.leases import check_lease_seconds
from kvd.core.requests import Blocks, TransferParams
from kvd.core.spec import check_request_id

U32 = 2**32  # block ids, token counts and TP/PP sizes travel as uint32

BlockIds = tuple[tuple[int, ...], ...]  # per KV cache group


@dataclass(frozen=True)
class GroupBlocks:
    """One KV cache group's blocks of a request: the ids that hold tokens,
    from ``first_token`` on (vLLM's null blocks before a window dropped)."""

    first_token: int
    ids: tuple[int, ...]


def group_blocks(ids: Sequence[int], block_size: int, num_tokens: int) -> GroupBlocks:
    """A vLLM block list of one group, as kvd moves it: null blocks (id 0,
    which vLLM puts before a sliding window or a chunk) are never read or
    written, and blocks past ``num_tokens`` hold nothing of the prompt."""
    ids = list(ids)[: -(-num_tokens // block_size)]
    lead = next((i for i, b in enumerate(ids) if b != 0), len(ids))
    return GroupBlocks(lead * block_size, tuple(ids[lead:]))


@dataclass(frozen=True)
class Publication:
    """What P's worker publishes for one finished prefill."""

    request_id: str
    block_ids: BlockIds
    num_tokens: int
    capability: bytes
    lease_seconds: float
    first_tokens: tuple[int, ...] = ()
    stream: bool = False  # published before the step computes it; its layers are saved as they are
    published: bool = False  # the scheduler published it for every rank: the workers only track it
    verify: str = ""  # the request's own verification (kv_transfer_params.kvd_verify), else the daemon's
    computed_at_ns: int = 0  # when the forward that computed the prompt ended (vllm_clock), for kvd_publish_delay_seconds


@dataclass(frozen=True)
class PublishAsked:
    """What a request's own params ask of its publication on P."""

    lease_seconds: float
    name: str  # "": vLLM's request id
    capability: bytes  # b"": a fresh one
    verify: str


VERIFY_MODES = ("", "off", "sampled", "full")  # "": the daemon's


def publish_asked(params: Mapping[str, Any], default_lease: float) -> PublishAsked:
    """Read ``kvd_lease_seconds``, ``kvd_publish_as`` with its ``kvd_capability``
    (a proxy that dispatched P and D at once named the publication), and
    ``kvd_verify``. vLLM's OpenAI server takes ``kv_transfer_params`` from the
    client's request body, so each is checked here and refused by name: read
    raw in the engine's scheduler, one client's ``"kvd_lease_seconds": "soon"``
    raised out of ``request_finished`` and killed the prefill engine."""
    raw = params.get("kvd_lease_seconds")
    try:
        lease = float(raw or default_lease)
    except (TypeError, ValueError, OverflowError):  # JSON gives ints of any length: float() of 10**400 overflows
        raise InvalidArgument("kvd_lease_seconds", raw, "must be a number of seconds") from None
    check_lease_seconds("kvd_lease_seconds", lease)
    name, capability = "", b""
    if params.get("kvd_publish_as"):
        name = check_request_id("kvd_publish_as", str(params["kvd_publish_as"]))
        try:
            capability = bytes.fromhex(str(params["kvd_capability"]))
        except (KeyError, ValueError):
            raise InvalidArgument("kvd_capability", params.get("kvd_capability"), "must be the hex capability picked for kvd_publish_as") from None
    verify = str(params.get("kvd_verify") or "")
    if verify not in VERIFY_MODES:
        raise InvalidArgument("kvd_verify", verify, "must be off, sampled or full")
    return PublishAsked(lease, name, capability, verify)


@dataclass(frozen=True)
class LoadRequest:
    """What D's worker pulls for one request: its own blocks, P's params."""

    request_id: str
    local_block_ids: BlockIds
    params: TransferParams
    local_first_tokens: tuple[int, ...] = ()
    priority: str = ""  # its place on a contended wire (kvd_priority, kvd_tenant, kvd_deadline_ms)
    tenant: str = ""
    deadline_ms: float = 0.0


# A request's place on a contended wire (a daemon with --qos on): passed from
# the client's kv_transfer_params by the proxy, to D's pull by the connector.
QOS_KEYS = ("kvd_priority", "kvd_tenant", "kvd_deadline_ms")


def with_qos(params: dict[str, Any], request: object) -> dict[str, Any]:
    """``params`` with the QoS keys the client's ``request`` params carry."""
    return {**params, **{k: request[k] for k in QOS_KEYS if k in request}} if isinstance(request, Mapping) else params


def make_params(pub: Publication, *, engine_id: str, address: str, tp_size: int, pp_size: int, block_size: int,
                published: TransferParams | None = None) -> dict[str, Any]:
    """The JSON-safe dict P returns from ``request_finished``; with
    ``published`` (the daemon's params: it is published already), its
    generation and epoch, so D's daemon need not resolve them."""
    host, port = split_host_port(address)
    known = {"kvd_generation": published.generation, "kvd_epoch": published.remote_epoch} if published is not None else {}
    return {
        **known,
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
        "kvd_first_tokens": list(pub.first_tokens) or [0] * len(pub.block_ids),
        "kvd_capability": pub.capability.hex(),
        "kvd_lease_seconds": pub.lease_seconds,
    }


def stream_params(*, name: str, capability: bytes, engine_id: str, address: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Layer-wise streaming, dispatched to P and D at once (``kvd proxy
    --prefill-kvd``): P's params (publish under ``name`` and ``capability``
    as the prompt is computed) and D's (pull it from P's daemon at
    ``address`` as it streams; P's blocks come from its publication)."""
    host, port = split_host_port(address)
    prefill = {"do_remote_decode": True, "do_remote_prefill": False, "kvd_stream": True, "kvd_publish_as": name,
               "kvd_capability": capability.hex()}
    decode = {"do_remote_prefill": True, "do_remote_decode": False, "kvd_stream": True, "remote_engine_id": engine_id,
              "remote_request_id": name, "remote_block_ids": None, "remote_host": host, "remote_port": int(port),
              "kvd_capability": capability.hex()}
    return prefill, decode


def is_kvd_load(params: Mapping[str, Any] | None) -> bool:
    return params is not None and bool(params.get("do_remote_prefill")) and "kvd_capability" in params


def release_params(params: Mapping[str, Any]) -> TransferParams:
    """What D's daemon needs to tell P it will not read a publication."""
    check_params(params)
    return TransferParams(remote_engine_id=str(params["remote_engine_id"]), request_id=str(params["remote_request_id"]),
                          remote_address=host_port(params["remote_host"], int(params["remote_port"])),
                          capability=bytes.fromhex(str(params["kvd_capability"])), block_ids=(), num_tokens=0)


def check_params(params: Mapping[str, Any]) -> None:
    """Raise InvalidArgument naming what makes ``params`` unusable (no side effects)."""
    if params.get("kvd_stream"):
        load_request("check", params, [GroupBlocks(0, (1,))], [1], prompt_tokens=2)
        return
    groups = params.get("remote_block_ids")
    if not isinstance(groups, list) or not groups:
        raise InvalidArgument("remote_block_ids", groups, "must be a non-empty list of per-group block id lists")
    load_request("check", params, [GroupBlocks(0, (1,)) for _ in groups], [1] * len(groups))


def load_request(request_id: str, params: Mapping[str, Any], local: Sequence[GroupBlocks], block_sizes: Sequence[int], *,
                 state: Sequence[bool] = (), prompt_tokens: int = 0) -> LoadRequest:
    """D's pull for ``params``: per group, P's blocks into D's ``local`` ones,
    for every prompt token but the last (which D computes for the logits):
    of a ``prompt_tokens`` prompt, the first ``prompt_tokens - 1``, which P
    holds all of (a model with state has P stop there), else all but the
    last token P holds. A ``state`` group loads its one running state block.

    Tokens are the prompt's own positions on both sides, so D may start
    later than P in any group: after a prefix it holds in its own cache, or
    at a window (block sizes may differ). Only the blocks up to the last
    loaded token are read into; a group whose blocks start after it (a
    chunk that starts at the last token) loads nothing.
    """
    stream = bool(params.get("kvd_stream"))
    remote: list[list[int]]
    try:
        if stream:
            # Dispatched with P: its blocks and tokens are its publication's (D's daemon resolves them).
            remote, num_tokens = [[] for _ in local], prompt_tokens
        else:
            remote, num_tokens = [list(map(int, g)) for g in params["remote_block_ids"]], int(params["remote_num_tokens"])
        firsts = [int(x) for x in params.get("kvd_first_tokens", [0] * len(remote))]
        generation, epoch = int(params.get("kvd_generation", 0)), str(params.get("kvd_epoch", ""))
        capability = bytes.fromhex(str(params["kvd_capability"]))
        address = host_port(params["remote_host"], int(params["remote_port"]))
        engine_id, request_id = str(params["remote_engine_id"]), str(params["remote_request_id"])
        tp_size, pp_size = int(params.get("tp_size", 1)), int(params.get("pp_size", 1))
        lease_seconds = float(params.get("kvd_lease_seconds", 0.0))
        priority, tenant = str(params.get("kvd_priority", "")), str(params.get("kvd_tenant", ""))
        deadline_ms = float(params.get("kvd_deadline_ms", 0.0))  # its value is the daemon's to refuse, by name
    except KeyError as e:
        raise InvalidArgument("kv_transfer_params", sorted(params), f"lacks {e.args[0]!r}") from None
    except (TypeError, ValueError, OverflowError) as e:  # OverflowError: int() of JSON's 1e999 (inf), float() of a 400-digit int
        raise InvalidArgument("kv_transfer_params", dict(params), f"has a malformed value: {e}") from None
    if len(remote) != len(local):
        raise InvalidArgument("remote_block_ids", f"<{len(remote)} groups>", f"must match the {len(local)} local KV cache groups")
    if len(firsts) != len(remote):
        raise InvalidArgument("kvd_first_tokens", firsts, f"must give one token per group ({len(remote)})")
    if not 0 < num_tokens < U32:
        raise InvalidArgument("remote_num_tokens", num_tokens, f"must be in (0, {U32})")
    for g, theirs in enumerate(remote):  # the wire's ids are uint32: caught here, not when the worker sends them
        if theirs and not (min(theirs) >= 0 and max(theirs) < U32):
            raise InvalidArgument(f"remote_block_ids[{g}]", theirs, f"must be in [0, {U32})")
    for name, size in (("tp_size", tp_size), ("pp_size", pp_size)):
        if not 0 <= size < U32:
            raise InvalidArgument(name, size, f"must be in [0, {U32})")
    if not 0 <= generation < 2**64 or (generation > 0) != bool(epoch):
        raise InvalidArgument("kvd_generation", generation, f"must be 0, or positive with a kvd_epoch (got {epoch[:16]!r})")
    for g, first in enumerate(firsts):
        if not 0 <= first < num_tokens:
            raise InvalidArgument(f"kvd_first_tokens[{g}]", first, f"must be in [0, remote_num_tokens={num_tokens})")
    loaded = min(num_tokens, prompt_tokens - 1) if prompt_tokens else num_tokens - 1  # D computes the last prompt token itself
    if loaded <= 0:
        raise InvalidArgument("remote_num_tokens", num_tokens, "leaves nothing to load but the last token, which decode computes")
    ids: list[tuple[int, ...]] = []
    firsts_local: list[int] = []
    for g, (mine, bs) in enumerate(zip(local, block_sizes, strict=True)):
        if g < len(state) and state[g]:
            if not mine.ids or len(remote[g]) != (0 if stream else 1):
                raise InvalidArgument(f"remote_block_ids[{g}]", remote[g], f"and the local {list(mine.ids)} must each be one state block")
            ids.append(mine.ids[-1:])
            firsts_local.append(0)
            continue
        first = mine.first_token
        if first < loaded and not mine.ids:
            raise InvalidArgument(f"local_block_ids[{g}]", [], f"is empty from token {first}: nothing to load into")
        ids.append(mine.ids[: max(0, -(-(loaded - first) // bs))])  # blocks past the last loaded token hold nothing of P's
        firsts_local.append(first)
    tp = TransferParams(
        remote_engine_id=engine_id, remote_address=address, request_id=request_id, capability=capability,
        block_ids=tuple(Blocks(tuple(r), f) for r, f in zip(remote, firsts, strict=True)), num_tokens=loaded,
        remote_tp_size=tp_size, remote_pp_size=pp_size, lease_seconds=lease_seconds, stream=stream, generation=generation, remote_epoch=epoch,
    )
    return LoadRequest(request_id, tuple(ids), tp, tuple(firsts_local), priority, tenant, deadline_ms)
