"""The model zoo through kvd, as users run it (``pytest -m vllm``).

Each model of ``tests/zoo.py`` (the structure of a public config, the widths
small) runs as a P/D pair of OpenAI servers, each beside its own
``kvd serve``, behind ``kvd proxy``, P on core 0 and D on core 1. Its
prompts' tokens through kvd equal the oracle's: one engine (P itself, asked
plainly) where P/D and one engine agree exactly, which is float32; for a
model whose CPU kernels run bf16 only (Qwen3-Next's gated delta-net), where
P/D (P stops a token short, D runs the last one with the recurrent step)
rounds differently from one engine's chunked scan, vLLM's own NixlConnector's
P/D on the same prompts. The negative control zeroes P's cache between
prefill and decode: D's tokens then differ.

Each run appends its row (model, source, TP pair, oracle, outcome, bytes D
received) to ``$KVD_ZOO_RESULTS`` if set, for the README's table.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests import vllm_env
from tests.conftest import REPO, Daemons, scrape
from tests.vllm_support import (
    OpenAIPD,
    complete_pd,
    drive,
    kill_group,
    make_zoo_model,
    nixl_pd,
    pd_by_hand,
    prefill_alone,
    serve,
    wait_http,
    zoo_engine_args,
    zoo_prompts,
)
from tests.zoo import ZOO, ZooModel

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]


def _nixl_oracle(py: Path, model: Path, m: ZooModel, tmp: Path, prompts: list[list[int]]) -> list[list[int]]:
    """NixlConnector's P/D tokens for ``prompts``, on the same engines' settings, cores and a kvd-agnostic proxy."""
    overlay, why = vllm_env.nixl_overlay()
    assert overlay is not None, f"NIXL could not be installed for the oracle: {why}"
    pd = nixl_pd(py, model, tmp, overlay, *zoo_engine_args(m))
    try:
        url = pd.proxy([str(py), str(REPO / "tests" / "generic_pd_proxy.py")], tmp / "nixl-proxy.log")
        return [complete_pd(pd, url, model, p) for p in prompts]
    finally:
        for proc in pd.procs:
            kill_group(proc)


@pytest.mark.parametrize("name", list(ZOO))
def test_a_zoo_model_through_kvd_gives_its_oracles_tokens(vllm_python, tmp_path, name):

    m = ZOO[name]
    model = make_zoo_model(vllm_python, name, tmp_path / name)
    prompts = zoo_prompts(name, m)
    oracle = "NixlConnector P/D" if m.dtype != "float32" else "one engine"
    expected = _nixl_oracle(vllm_python, model, m, tmp_path, prompts) if oracle != "one engine" else None
    ds = Daemons(tmp_path)
    p, d = ds.start("prefill"), ds.start("decode")
    servers, procs = {}, []
    try:
        for role, daemon, cpus in (("prefill", p, "0"), ("decode", d, "1")):
            config = {"kv_connector": "KvdConnector", "kv_connector_module_path": "kvd.integrations.vllm", "kv_load_failure_policy": "recompute",
                      "kv_role": "kv_producer" if role == "prefill" else "kv_consumer", "kv_connector_extra_config": {"kvd_address": daemon.grpc}}
            servers[role] = serve(vllm_python, model, tmp_path / f"{role}-server.log", *zoo_engine_args(m), "--kv-transfer-config", json.dumps(config),
                                   cpus=cpus)
            procs.append(servers[role].proc)
        for s in servers.values():
            wait_http(f"{s.url}/health", s.proc, 600, s.log)
        pd = OpenAIPD(servers["prefill"], servers["decode"], d.metrics_url, p.grpc, p.metrics_url, procs,
                      [s.log for s in servers.values()] + [p.log_path, d.log_path])
        url = pd.proxy([sys.executable, "-m", "kvd", "proxy"], tmp_path / "proxy.log")
        if expected is None:  # one engine: P itself, asked plainly (its prefix cache then holds what it computed)
            expected = [prefill_alone(pd.prefill.url, model, pr) for pr in prompts]
        got = [complete_pd(pd, url, model, pr) for pr in prompts[:-1]]
        moved = scrape(d.metrics_url, "kvd_received_bytes_total", transport="tcp")
        failures = scrape(d.metrics_url, "kvd_pull_failures_total")
        # Negative control: vLLM's P/D convention by hand, P's cache zeroed (asserted: some bytes) between prefill and decode.
        control = pd_by_hand(pd.prefill, pd.decode, p.grpc, model, prompts[-1], corrupt=True)
    finally:
        for proc in procs:
            kill_group(proc)
        ds.kill_all()
    row = {"model": name, "source": m.source, "tp": "TP1 -> TP1", "dtype": m.dtype, "oracle": oracle, "prompts": [len(x) for x in prompts[:-1]],
           "match": got == expected[:-1], "bytes": moved, "failures": failures}
    if os.environ.get("KVD_ZOO_RESULTS"):
        with open(os.environ["KVD_ZOO_RESULTS"], "a") as f:
            f.write(json.dumps(row) + "\n")
    assert got == expected[:-1], row
    assert moved > 0 and failures == 0, row
    assert control != expected[-1], "zeroing P's cache did not change D's tokens"


HETERO = [(name, p_tp, d_tp) for name, m in ZOO.items() if m.tp2 and m.dtype == "float32" for p_tp, d_tp in ((2, 1), (1, 2))]


@pytest.mark.zoo_hetero
@pytest.mark.parametrize(("name", "p_tp", "d_tp"), HETERO, ids=[f"{n}-tp{p}-to-tp{d}" for n, p, d in HETERO])
def test_a_zoo_model_across_tp_sizes_matches_one_engine(vllm_python, daemons, tmp_path, name, p_tp, d_tp):
    """Hetero TP both ways, in float32, in-process engines (``pytest -m
    zoo_hetero``: about 3 minutes a case, so not in ``make test``, where the
    zoo's TP1 pairs and Granite 4.0-H's TP2 pairs run; its outcomes are in
    the README's zoo table)."""

    m = ZOO[name]
    model = make_zoo_model(vllm_python, name, tmp_path / name)
    *prompts, control = zoo_prompts(name, m)
    alone = tmp_path / "alone.json"
    alone.write_text(json.dumps([*prompts, control]))
    p, d = daemons.start("prefill"), daemons.start("decode")
    kw = {"kv_cache_memory_bytes": m.kv_cache_mib << 20, **({"enable_prefix_caching": False} if m.state else {})}
    result, _ = drive(vllm_python, tmp_path, "hetero", model, "--p-kvd", p.grpc, "--d-kvd", d.grpc, "--dtype", m.dtype,
                       "--p-tp", str(p_tp), "--d-tp", str(d_tp), "--llm-kw", json.dumps(kw), "--baseline-prompts", str(alone),
                       prompts_list=[*prompts, control])
    baseline = result["baseline_tokens"]
    row = {"model": name, "source": m.source, "tp": f"TP{p_tp} -> TP{d_tp}", "dtype": m.dtype, "oracle": "one engine",
           "match": result["tokens"] == baseline[:-1], "bytes": scrape(d.metrics_url, "kvd_received_bytes_total", transport="tcp")}
    if os.environ.get("KVD_ZOO_RESULTS"):
        with open(os.environ["KVD_ZOO_RESULTS"], "a") as f:
            f.write(json.dumps(row) + "\n")
    assert result["tokens"] == baseline[:-1], row
    assert result["corrupted_bytes"] > 0 and result["corrupted_tokens"] != baseline[-1]
