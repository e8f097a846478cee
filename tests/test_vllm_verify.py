"""Verification on real vLLM engines: both daemons run ``--verify sampled``
(vLLM's CPU cache, K stored transposed beside V, across a TP split and two
block sizes), loads verify clean and give one engine's tokens, and P's
cache altered after publication is caught and recomputed."""

from __future__ import annotations

import pytest

from tests.conftest import scrape
from tests.vllm_support import drive

# The first vLLM test a run reaches builds the environment and the model (minutes, in its setup, which the timeout counts).
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]


def test_a_verified_hetero_pd_matches_one_engine_and_catches_an_altered_prefill_cache(vllm_python, model_dir, baseline_f32, daemons, tmp_path):
    p, d = daemons.start("prefill", "--verify", "sampled"), daemons.start("decode", "--verify", "sampled")
    result, _log = drive(vllm_python, tmp_path, "hetero", model_dir, "--p-kvd", p.grpc, "--d-kvd", d.grpc, "--dtype", "float32",
                         "--p-tp", "1", "--p-block-size", "64", "--d-tp", "2", "--d-block-size", "128")
    assert result["tokens"] == baseline_f32[:-1]
    assert scrape(p.metrics_url, "kvd_verify_digests_total") >= len(baseline_f32)
    # The negative control: P's cache zeroed after publishing. Without
    # verification D decodes from it and its tokens change (tests/test_vllm.py);
    # with it, the load fails exactly where the bytes differ, and D
    # recomputes the prompt to one engine's tokens.
    assert result["corrupted_bytes"] > 0
    assert result["corrupted_tokens"] == baseline_f32[-1]
    assert scrape(d.metrics_url, "kvd_verify_checks_total", result="mismatch") == 2  # each D rank's load of it
    assert scrape(d.metrics_url, "kvd_verify_mismatches_total") > 0
    assert scrape(d.metrics_url, "kvd_pull_failures_total", reason="verify_mismatch") == 2
    # Every other load verified clean: the P/D prompts and the recomputed
    # failed load's neighbours (2 D ranks each).
    assert scrape(d.metrics_url, "kvd_verify_checks_total", result="ok") >= 2 * (len(baseline_f32) - 1)
    assert scrape(d.metrics_url, "kvd_verify_checks_total", result="unverified") == 0
