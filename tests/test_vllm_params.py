"""The vLLM connector's pure parts, without vLLM: params in and out, and the proxy's requests."""

from __future__ import annotations

import pytest

from kvd.core.errors import InvalidArgument
from kvd.integrations.kv_params import (
    GroupBlocks,
    Publication,
    check_params,
    group_blocks,
    is_kvd_load,
    load_request,
    make_params,
    stream_params,
)
from kvd.integrations.pd_proxy import decode_request, prefill_request


def _params(block_ids=(3, 4, 5), num_tokens=300) -> dict:
    pub = Publication("cmpl-1-abcd", (tuple(block_ids),), num_tokens, bytes(range(32)), 30.0)
    return make_params(pub, engine_id="prefill", address="10.0.0.7:50051", tp_size=2, pp_size=1, block_size=128)


def test_params_round_trip_into_a_pull():
    params = _params()
    assert is_kvd_load(params)
    load = load_request("d-req", params, [GroupBlocks(0, (7, 8, 9))], [128])
    p = load.params
    assert (p.remote_engine_id, p.remote_address, p.request_id) == ("prefill", "10.0.0.7:50051", "cmpl-1-abcd")
    # D loads all but the last prompt token, which it computes for the logits.
    assert list(p.block_ids[0].ids) == [3, 4, 5] and p.block_ids[0].first_token == 0 and p.num_tokens == 299
    assert p.capability == bytes(range(32)) and p.generation == 0 and p.remote_epoch == ""
    assert (p.remote_tp_size, p.lease_seconds) == (2, 30.0)
    assert load.local_block_ids == ((7, 8, 9),) and load.local_first_tokens == (0,)


def test_params_of_a_publication_the_scheduler_made_carry_its_generation_and_epoch():
    """Published already (``PublishEngine``): D's daemon need not resolve them."""
    from kvd.proto import kvd_pb2 as pb

    pub = Publication("cmpl-1-abcd", ((3, 4, 5),), 300, bytes(range(32)), 30.0)
    params = make_params(pub, engine_id="prefill", address="10.0.0.7:50051", tp_size=2, pp_size=1, block_size=128,
                         published=pb.TransferParams(generation=17, remote_epoch="e" * 32))
    p = load_request("d-req", params, [GroupBlocks(0, (7, 8, 9))], [128]).params
    assert (p.generation, p.remote_epoch) == (17, "e" * 32)
    assert "kvd_generation" not in _params()  # control: not published yet, D resolves them
    for bad in ({"kvd_generation": -1}, {"kvd_epoch": ""}, {"kvd_generation": 0}):
        with pytest.raises(InvalidArgument, match="kvd_generation"):
            load_request("d-req", {**params, **bad}, [GroupBlocks(0, (7, 8, 9))], [128])


def test_a_local_prefix_hit_starts_decode_later_and_p_stays_whole():
    # D holds 256 tokens already: its one block starts there; tokens are the
    # prompt's own positions, so P's list is not cut.
    load = load_request("d", _params(), [GroupBlocks(256, (9,))], [128])
    assert list(load.params.block_ids[0].ids) == [3, 4, 5] and load.params.num_tokens == 299
    assert load.local_first_tokens == (256,)
    # Other block sizes: D of 64-token blocks from token 128 needs 3 blocks for the 171 tokens left.
    load = load_request("d", _params(), [GroupBlocks(128, (20, 21, 22, 23))], [64])
    assert load.local_block_ids == ((20, 21, 22),) and load.local_first_tokens == (128,)


def test_vllm_group_lists_drop_null_blocks_before_a_window_and_blocks_past_the_prompt():
    # A sliding-window group of 16-token blocks: vLLM nulled the first 14.
    assert group_blocks([0] * 14 + [41, 42, 43, 44, 45], 16, 300) == GroupBlocks(224, (41, 42, 43, 44, 45))
    assert group_blocks([5, 6, 7, 8], 128, 300) == GroupBlocks(0, (5, 6, 7))
    assert group_blocks([0, 0], 16, 32) == GroupBlocks(32, ())


def test_window_groups_round_trip_their_first_tokens():
    pub = Publication("r", ((1, 2, 3), (41, 42)), 300, bytes(32), 0.0, (0, 224))
    params = make_params(pub, engine_id="p", address="h:1", tp_size=1, pp_size=1, block_size=128)
    load = load_request("d", params, [GroupBlocks(0, (7, 8, 9)), GroupBlocks(256, (50,))], [128, 128])
    assert [b.first_token for b in load.params.block_ids] == [0, 224]
    assert load.local_first_tokens == (0, 256)
    # A group that starts after the last loaded token loads nothing (a chunk starting there).
    load = load_request("d", params, [GroupBlocks(0, (7, 8, 9)), GroupBlocks(384, (50,))], [128, 128])
    assert load.local_block_ids == ((7, 8, 9), ())
    # A group with no blocks where it has tokens to load is refused by name.
    with pytest.raises(InvalidArgument, match=r"local_block_ids\[1\]"):
        load_request("d", params, [GroupBlocks(0, (7, 8, 9)), GroupBlocks(256, ())], [128, 128])
    with pytest.raises(InvalidArgument, match=r"kvd_first_tokens\[1\]=-16"):
        load_request("d", {**params, "kvd_first_tokens": [0, -16]}, [GroupBlocks(0, (7, 8, 9)), GroupBlocks(256, (50,))], [128, 128])


def test_blocks_allocated_past_the_prompt_are_not_written():
    load = load_request("d", _params(), [GroupBlocks(0, (1, 2, 3, 4))], [128])
    assert load.local_block_ids == ((1, 2, 3),)


@pytest.mark.parametrize(("mutate", "field"), [
    (lambda p: p.pop("kvd_capability"), "kvd_capability"),
    (lambda p: p.__setitem__("kvd_capability", "zz"), "malformed"),
    (lambda p: p.__setitem__("remote_block_ids", [[1], [2]]), "remote_block_ids"),
    # Out of the wire's uint32 range: refused here, where the scheduler turns it into a failed load,
    # not when the worker builds its message.
    (lambda p: p.__setitem__("remote_block_ids", [[3, -1, 5]]), "remote_block_ids[0]"),
    (lambda p: p.__setitem__("remote_block_ids", [[3, 2**32, 5]]), "remote_block_ids[0]"),
    (lambda p: p.__setitem__("remote_num_tokens", 2**32), "remote_num_tokens"),
    (lambda p: p.__setitem__("tp_size", -1), "tp_size"),
])
def test_bad_params_name_the_field(mutate, field):
    params = _params()
    mutate(params)
    with pytest.raises(InvalidArgument) as e:
        load_request("d", params, [GroupBlocks(0, (1, 2, 3))], [128])
    assert field in str(e.value)


def test_params_without_kvd_fields_are_not_ours():
    assert not is_kvd_load({"do_remote_prefill": True, "remote_block_ids": [[1]]})  # a NIXL request
    assert not is_kvd_load(None)
    assert not is_kvd_load({**_params(), "do_remote_prefill": False})  # already loaded


def test_proxy_asks_prefill_for_one_token_and_hands_its_params_to_decode():
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 16, "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 4}
    pre = prefill_request(body)
    assert pre["max_tokens"] == 1 and pre["stream"] is False and pre["kv_transfer_params"]["do_remote_decode"] is True
    assert "stream_options" not in pre and "min_tokens" not in pre
    assert body["max_tokens"] == 16  # the client's request is left alone
    dec = decode_request(body, {"kv_transfer_params": _params()})
    assert dec["kv_transfer_params"]["kvd_capability"] == bytes(range(32)).hex()
    assert dec["max_tokens"] == 16 and dec["stream"] is True and dec["min_tokens"] == 4


def test_the_clients_qos_keys_pass_through_the_proxy_into_the_pull():
    """kv_transfer_params' kvd_priority, kvd_tenant and kvd_deadline_ms: the
    proxy hands the client's to decode beside P's, the connector to its pull."""
    qos = {"kvd_priority": "interactive", "kvd_tenant": "gold", "kvd_deadline_ms": 250}
    dec = decode_request({"prompt": [1, 2], "kv_transfer_params": {**qos, "other": 1}}, {"kv_transfer_params": _params()})
    assert {k: dec["kv_transfer_params"][k] for k in qos} == qos and "other" not in dec["kv_transfer_params"]
    load = load_request("d-req", dec["kv_transfer_params"], [GroupBlocks(0, (7, 8, 9))], [128])
    assert (load.priority, load.tenant, load.deadline_ms) == ("interactive", "gold", 250.0)
    plain = load_request("d-req", _params(), [GroupBlocks(0, (7, 8, 9))], [128])
    assert (plain.priority, plain.tenant, plain.deadline_ms) == ("", "", 0.0)  # the defaults: today's order
    assert decode_request({"kv_transfer_params": "junk"}, {"kv_transfer_params": _params()})["kv_transfer_params"] == _params()
    with pytest.raises(InvalidArgument, match="kv_transfer_params"):
        load_request("d-req", {**_params(), "kvd_deadline_ms": "soon"}, [GroupBlocks(0, (7, 8, 9))], [128])


def test_check_params_refuses_what_load_request_would():
    from kvd.integrations.kv_params import check_params

    check_params(_params())
    for bad in ({**_params(), "remote_block_ids": []}, {k: v for k, v in _params().items() if k != "remote_host"},
                {**_params(), "kvd_capability": "not hex"}):
        with pytest.raises(InvalidArgument):
            check_params(bad)


def test_what_a_request_asks_of_its_publication_is_read_or_refused_by_name():
    """A client's own kv_transfer_params reach P's scheduler (vLLM's OpenAI
    server takes them from the body): each is refused by name, never raised
    raw into the engine (tests/test_vllm.py shows the engine survives)."""
    from kvd.integrations.kv_params import PublishAsked, publish_asked

    cap = bytes(range(32))
    assert publish_asked({}, 120.0) == PublishAsked(120.0, "", b"", "")
    assert publish_asked({"kvd_lease_seconds": "30", "kvd_verify": "full", "kvd_publish_as": "kvd-7", "kvd_capability": cap.hex()},
                         120.0) == PublishAsked(30.0, "kvd-7", cap, "full")
    for bad, field in (({"kvd_lease_seconds": "soon"}, "kvd_lease_seconds"), ({"kvd_lease_seconds": float("nan")}, "kvd_lease_seconds"),
                       ({"kvd_lease_seconds": [1]}, "kvd_lease_seconds"), ({"kvd_lease_seconds": -5}, "kvd_lease_seconds"),
                       ({"kvd_publish_as": "x", "kvd_capability": "not-hex"}, "kvd_capability"), ({"kvd_publish_as": "x"}, "kvd_capability"),
                       ({"kvd_publish_as": "x" * 300, "kvd_capability": cap.hex()}, "kvd_publish_as"), ({"kvd_verify": "always"}, "kvd_verify"),
                       ({"kvd_lease_seconds": 10**400}, "kvd_lease_seconds")):  # JSON's ints have no bound: float() overflows
        with pytest.raises(InvalidArgument) as e:
            publish_asked(bad, 120.0)
        assert e.value.field == field, bad


def test_release_params_name_the_publication():
    from kvd.integrations.kv_params import release_params

    r = release_params(_params())
    assert (r.remote_engine_id, r.request_id, r.remote_address, r.capability) == ("prefill", "cmpl-1-abcd", "10.0.0.7:50051", bytes(range(32)))


def test_streamed_params_leave_p_blocks_to_the_publication_and_load_all_but_the_last_token():
    cap = bytes(range(32))
    p, d = stream_params(name="kvd-1", capability=cap, engine_id="prefill", address="10.0.0.1:50051")
    assert p["kvd_publish_as"] == "kvd-1" and p["do_remote_decode"] and p["kvd_capability"] == cap.hex()
    assert is_kvd_load(d) and d["remote_request_id"] == "kvd-1"
    check_params(d)
    # Two groups, the second a state group: P's blocks are resolved later (none here), D's own are given.
    load = load_request("d-req", d, [GroupBlocks(0, (5, 6, 7)), GroupBlocks(0, (9,))], [16, 1], state=[False, True], prompt_tokens=40)
    t = load.params
    assert t.stream and t.num_tokens == 39 and t.request_id == "kvd-1" and t.capability == cap and t.remote_address == "10.0.0.1:50051"
    assert [list(b.ids) for b in t.block_ids] == [[], []] and load.local_block_ids == ((5, 6, 7), (9,))
    with pytest.raises(InvalidArgument, match="remote_num_tokens"):
        load_request("d-req", d, [GroupBlocks(0, (5,))], [16], prompt_tokens=1)  # nothing to load but the last token


def test_json_numbers_past_a_float_are_refused_as_params_not_raised():
    """JSON parses 1e999 as inf and keeps a 400-digit int whole: int() or
    float() of them raised OverflowError, which escaped the connector's
    checks (they caught ValueError) into vLLM's scheduler."""
    for key, value in (("remote_num_tokens", float("inf")), ("remote_num_tokens", 10**400), ("kvd_deadline_ms", 10**400),
                       ("remote_port", float("inf"))):
        with pytest.raises(InvalidArgument) as e:
            check_params({**_params(), key: value})
        assert e.value.field in ("kv_transfer_params", key), (key, e.value)


def test_connector_settings_refuse_a_lease_that_is_not_a_duration():
    from types import SimpleNamespace

    from kvd.integrations.vllm_settings import Settings

    def settings(**extra):
        return Settings.from_vllm(SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra)))

    assert settings(kvd_lease_seconds=30).lease_seconds == 30.0
    for bad in (float("nan"), 1e6, -1):
        with pytest.raises(InvalidArgument, match=r"kv_connector_extra_config\.kvd_lease_seconds"):
            settings(kvd_lease_seconds=bad)
