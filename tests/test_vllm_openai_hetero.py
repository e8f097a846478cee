"""Hetero TP between two OpenAI servers, as users run them (``pytest -m vllm``).

Two ``vllm serve`` processes, each beside its own ``kvd serve``, behind
``kvd proxy``, bound as the README says: the TP2 engine on
``VLLM_CPU_OMP_THREADS_BIND="0|1"`` (``--distributed-executor-backend mp``),
the TP1 engine on core 1, sharing it. P TP2 -> D TP1 and P TP1 -> D TP2, in
float32 (in bf16 a TP2 engine alone already differs from a TP1 one), four
prompts of 129-300 tokens, each token-identical to one engine.

This hung before the connector's idle wait: while P holds a request for D,
vLLM steps about 1 ms apart, each step wakes P's TP workers, and with a
connector poll costing 0.1 ms P's workers spun at 95-99% of the cores they
were bound to; a decode rank sharing one never ran its step. The negative
control zeroes P's cache between prefill and decode (through the same
servers, the P/D convention by hand): D's tokens then differ.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import Daemons, scrape
from tests.vllm_support import (
    BLOCK,
    HEAD_DIM,
    KV_HEADS,
    LAYERS,
    PROMPTS,
    OpenAIPD,
    blocks,
    complete_pd,
    kill_group,
    pd_by_hand,
    serve,
    wait_http,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

# P TP, P's binding, D TP, D's binding: the README's binding, and the TP1 engine on the TP2 engine's second core.
CASES = {"p_tp2_to_d_tp1": (2, "0|1", 1, "1"), "p_tp1_to_d_tp2": (1, "1", 2, "0|1")}
HETERO_PROMPTS = PROMPTS[:4]  # 300, 200, 129 and 260 tokens
F32_BYTES_PER_BLOCK_PER_LAYER = KV_HEADS * BLOCK * 2 * HEAD_DIM * 4  # K and V, float32, all heads


@dataclass
class Pair:
    pd: OpenAIPD
    url: str  # kvd proxy
    p_grpc: str
    d_metrics: str
    p_tp: int
    d_tp: int


def _start(py: Path, model: Path, tmp: Path, case: str) -> tuple[Pair, Daemons]:
    p_tp, p_cpus, d_tp, d_cpus = CASES[case]
    ds = Daemons(tmp)
    p, d = ds.start("prefill"), ds.start("decode")
    servers = {}
    procs = []
    for name, daemon, role, tp, cpus in (("prefill", p, "kv_producer", p_tp, p_cpus), ("decode", d, "kv_consumer", d_tp, d_cpus)):
        config = {"kv_connector": "KvdConnector", "kv_connector_module_path": "kvd.integrations.vllm", "kv_role": role,
                  "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"kvd_address": daemon.grpc}}
        extra = ["--dtype", "float32", "--kv-transfer-config", json.dumps(config)]
        if tp > 1:
            extra += ["--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp"]
        servers[name] = serve(py, model, tmp / f"{name}-server.log", *extra, cpus=cpus)
        procs.append(servers[name].proc)
    pd = OpenAIPD(servers["prefill"], servers["decode"], d.metrics_url, p.grpc, p.metrics_url, procs,
                  [s.log for s in servers.values()] + [p.log_path, d.log_path])
    try:
        for s in servers.values():
            wait_http(f"{s.url}/health", s.proc, 600, s.log)
        url = pd.proxy([sys.executable, "-m", "kvd", "proxy"], tmp / "proxy.log")
    except BaseException:
        for proc in procs:
            kill_group(proc)
        ds.kill_all()
        raise
    return Pair(pd, url, p.grpc, d.metrics_url, p_tp, d_tp), ds


@pytest.mark.parametrize("case", list(CASES))
def test_hetero_tp_between_openai_servers_with_users_binding_matches_one_engine(vllm_python, model_dir, baseline_f32, tmp_path, case):
    pair, ds = _start(vllm_python, model_dir, tmp_path, case)
    try:
        for prompt, expected in zip(HETERO_PROMPTS, baseline_f32[:4], strict=True):
            assert complete_pd(pair.pd, pair.url, model_dir, prompt) == expected
        # Every prompt's KV crossed through kvd (all but its last token, which D computes),
        # each D rank reading its heads: the whole cache once over all ranks.
        moved = scrape(pair.d_metrics, "kvd_received_bytes_total", transport="tcp")
        assert moved == sum(blocks(len(p) - 1) for p in HETERO_PROMPTS) * LAYERS * F32_BYTES_PER_BLOCK_PER_LAYER
        assert scrape(pair.d_metrics, "kvd_pull_failures_total") == 0
        # Negative control: the same path by hand, P's cache zeroed between prefill and decode, gives other tokens.
        assert pd_by_hand(pair.pd.prefill, pair.pd.decode, pair.p_grpc, model_dir, PROMPTS[5], corrupt=False) == baseline_f32[5]
        assert pd_by_hand(pair.pd.prefill, pair.pd.decode, pair.p_grpc, model_dir, PROMPTS[4], corrupt=True) != baseline_f32[4]
    finally:
        for proc in pair.pd.procs:
            kill_group(proc)
        ds.kill_all()
