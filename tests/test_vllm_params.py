"""The vLLM connector's pure parts, without vLLM: params in and out, and the proxy's requests."""

from __future__ import annotations

import pytest

from kvd.core.errors import InvalidArgument
from kvd.integrations.kv_params import Publication, is_kvd_load, load_request, make_params
from kvd.integrations.pd_proxy import decode_request, prefill_request


def _params(block_ids=(3, 4, 5), num_tokens=300) -> dict:
    pub = Publication("cmpl-1-abcd", (tuple(block_ids),), num_tokens, bytes(range(32)), 30.0)
    return make_params(pub, engine_id="prefill", address="10.0.0.7:50051", tp_size=2, pp_size=1, block_size=128)


def test_params_round_trip_into_a_pull():
    params = _params()
    assert is_kvd_load(params)
    load = load_request("d-req", params, [[7, 8, 9]], block_size=128)
    p = load.params
    assert (p.remote_engine_id, p.remote_address, p.request_id) == ("prefill", "10.0.0.7:50051", "cmpl-1-abcd")
    assert list(p.block_ids[0].ids) == [3, 4, 5] and p.num_tokens == 300
    assert p.capability == bytes(range(32)) and p.generation == 0 and p.remote_epoch == ""
    assert (p.remote_tp_size, p.lease_seconds) == (2, 30.0)
    assert load.local_block_ids == ((7, 8, 9),)


def test_a_local_prefix_hit_reads_only_the_tail_of_p_blocks():
    load = load_request("d", _params(), [[9]], block_size=128)
    assert list(load.params.block_ids[0].ids) == [5]
    assert load.params.num_tokens == 300 - 2 * 128


def test_other_block_sizes_pair_by_tokens_from_d_prefix_hit():
    # P: 3 blocks of 128 for 300 tokens. D with 64-token blocks holds 128 tokens already:
    # it reads P's blocks from the second on, 172 tokens, into ceil(172 / 64) = 3 blocks.
    load = load_request("d", _params(), [[20, 21, 22, 23]], block_size=64, hit_tokens=128)
    assert list(load.params.block_ids[0].ids) == [4, 5] and load.params.num_tokens == 172
    assert load.local_block_ids == ((20, 21, 22),)
    # D with 256-token blocks and no hit: all of P's blocks into two of D's.
    load = load_request("d", _params(), [[30, 31]], block_size=256, hit_tokens=0)
    assert list(load.params.block_ids[0].ids) == [3, 4, 5] and load.local_block_ids == ((30, 31),)
    # A hit that ends inside one of P's blocks cannot be read from P (it would write D's cached blocks).
    with pytest.raises(InvalidArgument, match="hit_tokens=64 ends inside a remote block of 128"):
        load_request("d", _params(), [[20, 21, 22, 23]], block_size=64, hit_tokens=64)
    with pytest.raises(InvalidArgument, match="hit_tokens"):  # block sizes differ: the hit must be given
        load_request("d", _params(), [[20, 21, 22]], block_size=64)


def test_blocks_allocated_past_the_prompt_are_not_written():
    load = load_request("d", _params(), [[1, 2, 3, 4]], block_size=128)
    assert load.local_block_ids == ((1, 2, 3),)


@pytest.mark.parametrize(("mutate", "field"), [
    (lambda p: p.pop("kvd_capability"), "kvd_capability"),
    (lambda p: p.__setitem__("kvd_capability", "zz"), "malformed"),
    (lambda p: p.__setitem__("remote_block_ids", [[1], [2]]), "remote_block_ids"),
])
def test_bad_params_name_the_field(mutate, field):
    params = _params()
    mutate(params)
    with pytest.raises(InvalidArgument) as e:
        load_request("d", params, [[1, 2, 3]], block_size=128)
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


def test_check_params_refuses_what_load_request_would():
    from kvd.integrations.kv_params import check_params

    check_params(_params())
    for bad in ({**_params(), "remote_block_ids": []}, {k: v for k, v in _params().items() if k != "remote_host"},
                {**_params(), "kvd_capability": "not hex"}):
        with pytest.raises(InvalidArgument):
            check_params(bad)


def test_release_params_name_the_publication():
    from kvd.integrations.kv_params import release_params

    r = release_params(_params())
    assert (r.remote_engine_id, r.request_id, r.remote_address, r.capability) == ("prefill", "cmpl-1-abcd", "10.0.0.7:50051", bytes(range(32)))
