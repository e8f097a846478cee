"""A real vLLM engine on CPU, disaggregated through kvd (``pytest -m vllm``).

The engines run in their own environment (tests/vllm_env.py builds it on
first use); kvd daemons run from this one, as in production. A tiny Llama
with seeded random weights keeps each engine start near 30 s, and makes the
tokens depend on the KV cache (vLLM's dummy weights barely do).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvd.daemon.metrics import PULL_PHASES
from kvd.regions import shm
from tests import vllm_env
from tests.conftest import REPO, Daemons, scrape, wait_for
from tests.vllm_driver import PREEMPTED_TOKENS
from tests.vllm_support import (
    BYTES_PER_BLOCK_PER_LAYER,
    HEAD_DIM,
    KV_HEADS,
    LAYERS,
    PROMPTS,
    OpenAIPD,
    Server,
    StreamError,
    assert_released_by_reader,
    blocks,
    complete,
    complete_pd,
    drive,
    engine_env,
    kill_group,
    nixl_pd,
    openai_pd_servers,
    received_bytes,
    serve,
    wait_http,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

def test_prefill_and_decode_engines_through_kvd_match_one_engine(vllm_python, model_dir, baseline, daemons, tmp_path):
    clocks = set(Path("/dev/shm").glob("kvd-forward-clock-*"))
    p, d = daemons.start("prefill"), daemons.start("decode")
    result, log = drive(vllm_python, tmp_path, "pd", model_dir, "--p-kvd", p.grpc, "--d-kvd", d.grpc)
    pd_prompts = PROMPTS[:-1]

    # Exactly the tokens of the single engine.
    assert result["tokens"] == baseline[:-1]
    for check in result["checks"]:
        # The params name P's daemon, its engine, the blocks and a capability.
        params = check["params"]
        assert params["remote_engine_id"] == "prefill" and f"{params['remote_host']}:{params['remote_port']}" == p.grpc
        assert len(params["remote_block_ids"][0]) == blocks(len(pd_prompts[check["prompt"]]))
        assert len(bytes.fromhex(params["kvd_capability"])) == 32
        # P's scheduler published it for every rank as it finished: the params carry its generation.
        assert params["kvd_generation"] > 0 and params["kvd_epoch"], params
        # P kept the blocks until D read them, then let them go.
        assert check["held_before_read"], check
        assert check["released_after_read_s"] < 10

    # With D's prefix cache holding the first prompt's full blocks, D read only the tail.
    assert result["prefix_hit_tokens"] == baseline[0]
    assert result["prefix_hit_released_after_s"] < 10

    # D really loaded the KV through kvd: its byte counter is exactly the blocks of
    # each prompt but its last token (D computes that one for the logits), each
    # prompt once, plus the one tail block of the prefix-hit repeat, and of each streamed
    # request that finished before its preemption (vllm_driver.PREEMPTED_TOKENS: D read it).
    loaded_blocks = sum(blocks(len(pr) - 1) for pr in PROMPTS) + 1 + len(result["preempted_stream"]["finished_first"])
    assert received_bytes(d.metrics_url) == loaded_blocks * LAYERS * BYTES_PER_BLOCK_PER_LAYER
    # Each publication carried the end of the forward that computed its prompt, stamped by
    # P's worker: P's daemon observed the delay to it (0 until then: kvd_publish_delay_seconds).
    stamped = scrape(p.metrics_url, "kvd_publish_delay_seconds_count", by="engine")
    assert stamped >= len(result["checks"]) and scrape(p.metrics_url, "kvd_publish_delay_seconds_count", by="worker") == 0, stamped
    # Its file is gone (vLLM's engine process ends with os._exit, which runs no atexit): no clock
    # file is left whose creator has exited (one a live process holds may be another test's).
    assert {f for f in set(Path("/dev/shm").glob("kvd-forward-clock-*")) - clocks if not shm.pid_alive(int(f.name.split("-")[3]))} == set()
    print(f"\nP published {stamped:.0f} prompts {scrape(p.metrics_url, 'kvd_publish_delay_seconds_sum', by='engine') / stamped * 1e3:.2f} ms "
          "after their forward ended, on average")
    # Published before D had the params: D's daemon never waited to resolve them (but for
    # each streamed request that finished first: D read it by name, as a stream is read).
    assert scrape(d.metrics_url, "kvd_pull_phase_seconds_count", phase="resolve") == len(result["preempted_stream"]["finished_first"])
    assert scrape(d.metrics_url, "kvd_pull_phase_seconds_count", phase="transfer") >= len(PROMPTS)

    # A streamed prefill preempted after its publication, from outside vLLM's
    # schedule (reset_prefix_cache(reset_running_requests=True), as
    # pause_generation(clear_cache=True) does), and resumed by the next step
    # (so it reads RUNNING again): vLLM freed the blocks it was published with,
    # so that step ends the publication, and P computes the request as its own.
    # (Before: the resumed request was published again under the same name,
    # refused, and vLLM's engine died: assert request.is_finished().)
    preempted = result["preempted_stream"]
    assert preempted["published"] and preempted["ended_after_s"] < 5, preempted
    assert f"publication {preempted['name']} ended" in log
    assert len(preempted["tokens"]) == PREEMPTED_TOKENS and preempted["tokens"][0] == baseline[1][0], preempted
    # A try whose request finished before the reset preempted nothing (vllm_driver.PREEMPTED_TOKENS):
    # D read its publication, which must then be the prompt's, as any other.
    assert all(tried["read_by_d"] == baseline[1][:1] for tried in preempted["finished_first"]), preempted

    # Negative control: zero P's cache between prefill and decode, and the output changes.
    assert result["corrupted_bytes"] > 0
    assert result["corrupted_tokens"] != baseline[-1]

    # An abandoned prefill is released by lease expiry, reported to vLLM as
    # finished_sending (P's worker logs it), and P keeps serving correctly.
    abandoned = result["abandoned"]
    assert abandoned["released_after_s"] < 15
    assert f"send of request {abandoned['request_id']} expired" in log
    assert result["after_expiry_tokens"] == baseline[0]


# P TP, P block size, D TP, D block size: each case changes both, in opposite directions.
HETERO = {"p_tp2_b128_to_d_tp1_b64": (2, 128, 1, 64), "p_tp1_b64_to_d_tp2_b128": (1, 64, 2, 128)}


@pytest.mark.parametrize("case", list(HETERO))
def test_other_tp_and_block_size_on_each_side_match_one_engine(vllm_python, model_dir, baseline_f32, daemons, tmp_path, case):
    """vLLM's CPU cache described as data: re-blocked both ways and gathered
    or split across TP sizes by kvd's one relayout (float32: in bf16 a TP2
    engine alone already gives other tokens than a TP1 engine)."""
    p_tp, p_bs, d_tp, d_bs = HETERO[case]
    p, d = daemons.start("prefill"), daemons.start("decode")
    result, log = drive(vllm_python, tmp_path, "hetero", model_dir, "--p-kvd", p.grpc, "--d-kvd", d.grpc, "--dtype", "float32",
                       "--p-tp", str(p_tp), "--p-block-size", str(p_bs), "--d-tp", str(d_tp), "--d-block-size", str(d_bs))
    assert result["tokens"] == baseline_f32[:-1]
    assert received_bytes(d.metrics_url) > 0

    # A load that failed (a block P never published): P held the request until
    # then, and let it go when D's daemon told it, not at its lease's end.
    failed = result["failed_load"]
    assert failed["held_before"], failed
    assert_released_by_reader(p, failed)
    assert scrape(p.metrics_url, "kvd_reader_releases_total") >= 1
    # Every rank stamped its forward's end (a TP2 P's workers are other processes than its scheduler).
    assert scrape(p.metrics_url, "kvd_publish_delay_seconds_count", by="engine") >= len(result["tokens"])
    # Named if the count is off: D's failed pulls, and what D's workers logged of kvd (a lost link re-registers, ending its pulls).
    failures = [line for line in d.log().splitlines() if "pull failed" in line or "registered worker" in line]
    failures += [line for line in log.splitlines() if "kvd:" in line and ("lost" in line or "again" in line or "refused" in line)]
    # (A string, not a list: pytest shows a string message whole.)
    assert scrape(d.metrics_url, "kvd_pull_failures_total") == d_tp, "\n".join(failures)  # that load, on each D rank; nothing else failed
    # Its invalid blocks were exact: D recomputed them and still gives one engine's tokens.
    assert failed["tokens"] == baseline_f32[0]
    # A pull D's daemon refused (its answer not awaited by the step): reported
    # failed by a later step, and computed by D, to one engine's tokens; it
    # was never accepted, so it is not among the pulls that failed above.
    assert result["refused_load"]["tokens"] == baseline_f32[0]
    assert "refused by the local daemon (INVALID_ARGUMENT): params.remote_engine_id" in log, log[-3000:]

    # Negative control: zero P's cache between prefill and decode, and the output changes.
    assert result["corrupted_bytes"] > 0
    assert result["corrupted_tokens"] != baseline_f32[-1]


SW_WINDOW, SW_BLOCK, SW_P_BLOCK = 64, 32, 64  # CPU attention block sizes are multiples of 32
# 300 tokens; 159, where N - W + 1 starts one of D's blocks (vLLM would drop
# the block holding token N - W, were D to claim all N tokens); 127, where it
# starts one of P's (P dropped a token decode needs: refused, D recomputes);
# and the negative control's.
SW_PROMPTS = [PROMPTS[0], PROMPTS[1][:159], PROMPTS[2][:127], PROMPTS[3]]


@pytest.fixture(scope="module")
def sliding_model(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with layer 0 on a 64-token window."""
    d = tmp_path_factory.mktemp("tiny-llama-sw")
    r = subprocess.run([str(vllm_python), str(REPO / "tests" / "vllm_driver.py"), "make-model", "--model", str(d), "--sliding-window", str(SW_WINDOW)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return d


def test_a_sliding_window_model_from_tp2_moves_only_the_window_and_matches_one_engine(vllm_python, sliding_model, baseline_f32, daemons, tmp_path):
    """vLLM's hybrid allocator stays on with KvdConnector (it supports HMA):
    the windowed layer's group holds, and kvd moves, only its last window,
    here from a TP2 prefill of 64-token blocks to a TP1 decode of 32."""
    model = sliding_model
    p, d = daemons.start("prefill"), daemons.start("decode")
    alone = tmp_path / "alone.json"
    alone.write_text(json.dumps(SW_PROMPTS))
    # D computes the prompts alone first (one TP1 engine, float32, to compare with a TP2 prefill), then P/D runs.
    result, log = drive(vllm_python, tmp_path, "hetero", model, "--p-kvd", p.grpc, "--d-kvd", d.grpc, "--d-metrics", d.metrics_url,
                         "--dtype", "float32", "--p-tp", "2", "--p-block-size", str(SW_P_BLOCK), "--d-block-size", str(SW_BLOCK),
                         "--baseline-prompts", str(alone), prompts_list=SW_PROMPTS)
    sw_baseline = result["baseline_tokens"]
    # The window matters: the model's tokens are not the full-attention model's.
    assert sw_baseline[0] != baseline_f32[0]
    assert "group sliding_window(64)" in log and "group full" in log, "the hybrid allocator was turned off"
    assert result["tokens"] == sw_baseline[:-1]
    # Two groups in the params; the window's starts at P's first kept block.
    n = len(PROMPTS[0])
    params = result["params"][0]
    kept_from = n - SW_WINDOW + 1  # vLLM drops the blocks wholly before it
    assert sorted(params["kvd_first_tokens"]) == [0, kept_from // SW_P_BLOCK * SW_P_BLOCK], params
    # Bytes of the first request, whose n - 1 tokens D loads: every block of
    # the full layer, and of the window's, D's blocks from the one holding
    # token n - 64, the first that position n - 1 attends to (float32).
    per_block = KV_HEADS * SW_BLOCK * 2 * HEAD_DIM * 4
    full, window = -(-(n - 1) // SW_BLOCK), -(-(n - 1) // SW_BLOCK) - (n - SW_WINDOW) // SW_BLOCK
    assert result["received_bytes"][0] == (full + window) * per_block, (result["received_bytes"], full, window)
    assert scrape(d.metrics_url, "kvd_window_skipped_bytes_total", kind="sliding_window") > 0
    print(f"\nsliding window: a {n}-token request moved {result['received_bytes'][0]:.0f} bytes; full attention would move {2 * full * per_block}")
    # Two pulls failed: the 127-token prompt's (P dropped token 63, which
    # position 126 attends to) and the failed load below; both recomputed.
    assert scrape(d.metrics_url, "kvd_pull_failures_total") == 2, [line for line in d.log().splitlines() if "pull failed" in line]
    assert "group[0].first_token" in log or "group[1].first_token" in log
    # A failed load is exact: D recomputes and still gives one engine's tokens.
    assert result["failed_load"]["tokens"] == sw_baseline[0]
    assert_released_by_reader(p, result["failed_load"])
    # Negative control: P's cache zeroed between prefill and decode changes the output.
    assert result["corrupted_bytes"] > 0 and result["corrupted_tokens"] != sw_baseline[-1]




@pytest.fixture(scope="module")
def openai_pd(vllm_python, model_dir, tmp_path_factory) -> Iterator[OpenAIPD]:
    """A prefill and a decode OpenAI server, each beside its own kvd daemon."""
    with openai_pd_servers(vllm_python, model_dir, tmp_path_factory.mktemp("openai-pd")) as pd:
        yield pd


def _through_kvd_proxy(pd: OpenAIPD, model_dir: Path, log: Path, prompts: list[list[int]], expected: list[list[int]], *, streamed: bool) -> None:
    """Each prompt through ``kvd proxy`` (``--prefill-kvd``: streamed) gives
    one engine's tokens, and D loaded every block of each but its last
    token's through kvd; streamed, P said each layer of each prompt saved,
    each in its own report as the forward computed it, and the step's end."""
    url = pd.proxy([sys.executable, "-m", "kvd", "proxy", *(("--prefill-kvd", pd.p_grpc) if streamed else ())], log)
    before = received_bytes(pd.d_metrics)
    saves = scrape(pd.p_metrics, "kvd_stream_layers_saved_total")
    reports = scrape(pd.p_metrics, "kvd_stream_layer_save_reports_total")
    for prompt, tokens in zip(prompts, expected, strict=True):
        assert complete_pd(pd, url, model_dir, prompt) == tokens
    assert received_bytes(pd.d_metrics) - before == sum(blocks(len(pr) - 1) for pr in prompts) * LAYERS * BYTES_PER_BLOCK_PER_LAYER
    if streamed:
        assert scrape(pd.p_metrics, "kvd_stream_layers_saved_total") - saves == len(prompts) * LAYERS
        # The reports are one-way: the step's end (which D's read does not
        # wait for) may still be on its way when D's tokens are back.
        expected_reports = len(prompts) * (LAYERS + 1)
        def reports_since() -> float:
            return scrape(pd.p_metrics, "kvd_stream_layer_save_reports_total") - reports
        wait_for(lambda: reports_since() >= expected_reports, 10, f"fewer than {expected_reports} LayersSaved reports within 10 s")
        got = reports_since()
        assert got == expected_reports, f"{got} LayersSaved reports for {len(prompts)} prompts of {LAYERS} layers"


def test_openai_servers_behind_kvd_proxy_match_one_engine(openai_pd, model_dir, baseline, tmp_path):
    _through_kvd_proxy(openai_pd, model_dir, tmp_path / "proxy.log", PROMPTS[:2], baseline[:2], streamed=False)


def test_streamed_layer_by_layer_through_kvd_proxy_matches_one_engine(openai_pd, model_dir, baseline, tmp_path):
    """``kvd proxy --prefill-kvd``: P and D get each request at once. P
    publishes before its forward and says each layer saved as vLLM computes
    it (``save_kv_layer``); D's daemon reads each layer as it is saved."""
    _through_kvd_proxy(openai_pd, model_dir, tmp_path / "stream-proxy.log", PROMPTS[4:6], baseline[4:6], streamed=True)


def test_malformed_kvd_params_sent_to_prefill_leave_its_engine_serving(openai_pd, model_dir, baseline, tmp_path):
    """vLLM's OpenAI server takes ``kv_transfer_params`` from the request
    body: a client's own must not take the prefill engine down. P answers
    it, offers decode nothing, and serves the next P/D request exactly."""
    for bad in ({"kvd_lease_seconds": "soon"}, {"kvd_lease_seconds": float("nan")}, {"kvd_publish_as": "x", "kvd_capability": "not-hex"}):
        tokens = complete(openai_pd.prefill.url, model_dir, list(range(500, 540)), kv_transfer_params={"do_remote_decode": True, **bad})
        assert len(tokens) == 8, bad
    # And decode, sent a load it cannot make: it computes the prompt itself.
    junk = {"do_remote_prefill": True, "kvd_capability": "zz", "remote_block_ids": "junk", "remote_port": "http"}
    assert len(complete(openai_pd.decode.url, model_dir, list(range(600, 640)), kv_transfer_params=junk)) == 8
    url = openai_pd.proxy([sys.executable, "-m", "kvd", "proxy"], tmp_path / "proxy.log")
    assert complete_pd(openai_pd, url, model_dir, PROMPTS[1]) == baseline[1]


def test_a_proxy_that_knows_nothing_of_kvd_works_streamed_too(openai_pd, vllm_python, model_dir, baseline, tmp_path):
    """vLLM's P/D convention alone (tests/generic_pd_proxy.py) drives kvd: the
    prefill's kv_transfer_params go to decode unread, streamed or not."""
    url = openai_pd.proxy([str(vllm_python), str(REPO / "tests" / "generic_pd_proxy.py")], tmp_path / "generic-proxy.log")
    before = received_bytes(openai_pd.d_metrics)
    # Prompts D has not seen (the kvd proxy test sent the first two): no prefix hit.
    assert complete_pd(openai_pd, url, model_dir, PROMPTS[2]) == baseline[2]
    assert complete_pd(openai_pd, url, model_dir, PROMPTS[3], stream=True) == baseline[3]
    # The decode really loaded both prompts through kvd (and did not prefill them itself).
    assert received_bytes(openai_pd.d_metrics) - before == (blocks(len(PROMPTS[2]) - 1) + blocks(len(PROMPTS[3]) - 1)) * LAYERS * BYTES_PER_BLOCK_PER_LAYER


# vLLM prefills a prompt longer than its step's token budget over several
# steps (chunked prefill, on by default): the budget is 2048 tokens a rank on a CPU
# OpenAI server and 8192 on an H100's, so long prompts are always chunked.
# 64 here makes each of PROMPTS (129-300 tokens) take 3-5 steps, and every
# other chunk ends inside one of vLLM's 128-token CPU blocks.
CHUNK_TOKENS = 64


@pytest.fixture(scope="module")
def chunked_pd(vllm_python, model_dir, tmp_path_factory) -> Iterator[OpenAIPD]:
    """The README's P/D pair, both servers with ``--max-num-batched-tokens``."""
    with openai_pd_servers(vllm_python, model_dir, tmp_path_factory.mktemp("chunked-pd"),
                           server_args=("--max-num-batched-tokens", str(CHUNK_TOKENS))) as pd:
        assert f"'max_num_batched_tokens': {CHUNK_TOKENS}" in pd.prefill.log.read_text(), "the budget did not reach vLLM"
        yield pd


def test_prompts_prefilled_in_chunks_match_one_engine(chunked_pd, model_dir, baseline, tmp_path):
    """P computes each prompt over several steps and publishes once it
    finished: D loads the whole prompt but its last token and gives one
    engine's tokens."""
    _through_kvd_proxy(chunked_pd, model_dir, tmp_path / "proxy.log", PROMPTS[:2], baseline[:2], streamed=False)


def test_prompts_prefilled_in_chunks_stream_their_last_chunk_and_match_one_engine(chunked_pd, model_dir, baseline, tmp_path):
    """Streamed, P publishes in the step that computes the rest of the prompt
    (its earlier chunks' blocks are written by then) and says each layer
    saved as that step's forward computes it, so D's daemon may read each
    layer once it is saved, not once the prefill is over. (Before, a prompt
    prefilled in chunks was published when it finished, as if pulled: P
    said no layer saved.)"""
    _through_kvd_proxy(chunked_pd, model_dir, tmp_path / "stream-proxy.log", PROMPTS[4:6], baseline[4:6], streamed=True)


def _bench_serve(py: Path, url: str, model: Path, out: Path, log: Path, seed: int = 0) -> dict:
    # No ready-check request: exactly the 32 prompts go through (the servers are up already).
    cmd = [str(py), str(REPO / "tests" / "vllm_launcher.py"), "bench", "serve", "--backend", "vllm", "--base-url", url, "--model", str(model),
           "--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "16", "--ignore-eos", "--num-prompts", "32",
           "--max-concurrency", "4", "--seed", str(seed), "--ready-check-timeout-sec", "0", "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    with log.open("w") as f:
        r = subprocess.run(cmd, env=engine_env(), stdout=f, stderr=subprocess.STDOUT, timeout=900)
    assert r.returncode == 0, log.read_text()[-4000:]
    return json.loads(out.read_text())


WARM_PROMPT = [(5 * j) % 991 + 3 for j in range(256)]  # the one request a server gets before the figures


def _warm(url: str, model: Path) -> int:
    """One request through a fresh P/D pair first: its handshakes are not the
    figures'. Returns how many timings the proxy then holds, to skip."""
    complete(url, model, WARM_PROMPT, stream=True)
    return len(json.loads(urllib.request.urlopen(f"{url}/timings", timeout=10).read()))


def _proxy_timings(url: str, skip: int) -> dict[str, float]:
    """Medians (and means) of where the proxy saw each request's time to first token go."""
    rows = json.loads(urllib.request.urlopen(f"{url}/timings", timeout=10).read())[skip:]
    return {**{k: statistics.median(r[k] for r in rows) for k in ("prefill", "decode_first")},
            **{f"{k}_mean": statistics.mean(r[k] for r in rows) for k in ("prefill", "decode_first")}}


# vLLM's own per-request histograms. A request that loads its KV asynchronously
# is queued when it reaches the engine and scheduled only once its load
# finished, so "queued" on D holds its wait for the KV: the steps until the
# scheduler takes it up, kvd's pull, and the step that hears of the pull's end.
ENGINE_HISTOGRAMS = {"ttft": "vllm:time_to_first_token_seconds", "queued": "vllm:request_queue_time_seconds",
                     "first_token": "vllm:request_prefill_time_seconds", "e2e": "vllm:e2e_request_latency_seconds"}


def _engine_times(server_url: str) -> dict[str, tuple[float, float]]:
    """Each of ENGINE_HISTOGRAMS on a vLLM server so far: (seconds, count)."""
    return {k: (scrape(f"{server_url}/metrics", f"{name}_sum"), scrape(f"{server_url}/metrics", f"{name}_count"))
            for k, name in ENGINE_HISTOGRAMS.items()}


def _engine_parts(p_url: str, d_url: str, before: tuple[dict, dict], proxy: dict[str, float]) -> dict[str, float]:
    """Where the requests since ``before`` spent their time in P's and D's
    engines, by vLLM's own clocks (means, ms): D's time to first token is
    its arrival (tokenizing, reaching the engine), its wait for the KV
    (queued), and its first token once scheduled; the rest of what the
    proxy saw is HTTP and the proxy."""
    out = {}
    for side, url, was in (("p", p_url, before[0]), ("d", d_url, before[1])):
        now = _engine_times(url)
        for k in now:
            n = now[k][1] - was[k][1]
            out[f"{side}_{k}"] = (now[k][0] - was[k][0]) / n * 1e3 if n else float("nan")
    out["d_arrival"] = out["d_ttft"] - out["d_queued"] - out["d_first_token"]
    out["d_http"] = proxy["decode_first_mean"] - out["d_ttft"]
    out["p_http"] = proxy["prefill_mean"] - out["p_e2e"]
    return out


def _pull_seconds(metrics_url: str) -> tuple[float, float]:
    return (scrape(metrics_url, "kvd_transfer_duration_seconds_sum"), scrape(metrics_url, "kvd_transfer_duration_seconds_count"))




PHASE_BOUNDS = ("0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1.0", "2.5", "5.0", "10.0", "30.0", "+Inf")


def _phase_seconds(metrics_url: str) -> dict[str, tuple[float, ...]]:
    """Each of D's pull phases so far: (seconds, count, then the histogram's cumulative bucket counts at PHASE_BOUNDS)."""
    return {ph: (scrape(metrics_url, "kvd_pull_phase_seconds_sum", phase=ph), scrape(metrics_url, "kvd_pull_phase_seconds_count", phase=ph),
                 *(scrape(metrics_url, "kvd_pull_phase_seconds_bucket", phase=ph, le=le) for le in PHASE_BOUNDS))
            for ph in PULL_PHASES}


def _median_bound_ms(before: tuple[float, ...], after: tuple[float, ...]) -> str:
    """The bucket bound below which half of the phase's new observations fell: a few slow
    pulls make a phase's mean on shared cores, so its median is told apart."""
    count = after[1] - before[1]
    for le, b, a in zip(PHASE_BOUNDS, before[2:], after[2:], strict=True):
        if count and a - b >= count / 2:
            return "inf" if le == "+Inf" else f"{float(le) * 1e3:g}"
    return "-"


def _kvd_pd_bench(openai_pd: OpenAIPD, py: Path, model: Path, tmp: Path, seed: int) -> tuple[dict, dict[str, float]]:
    """``vllm bench serve`` through kvd's P/D and the kvd-agnostic proxy: every
    request completes and D loaded every prompt through kvd. Returns the
    bench's result and where its time to first token went."""
    url = openai_pd.proxy([str(py), str(REPO / "tests" / "generic_pd_proxy.py")], tmp / "generic-proxy.log")
    skip = _warm(url, model)
    before, pulls_before = received_bytes(openai_pd.d_metrics), _pull_seconds(openai_pd.d_metrics)
    phases_before = _phase_seconds(openai_pd.d_metrics)
    engines_before = (_engine_times(openai_pd.prefill.url), _engine_times(openai_pd.decode.url))
    pd = _bench_serve(py, url, model, tmp / "pd.json", tmp / "bench-pd.log", seed)
    assert (pd["completed"], pd.get("failed", 0)) == (32, 0), pd
    pulls = [a - b for a, b in zip(_pull_seconds(openai_pd.d_metrics), pulls_before, strict=True)]
    phases_after = _phase_seconds(openai_pd.d_metrics)
    # Mean ms a pull spent in each phase (resolve: params made before P published, as vLLM's scheduler makes them).
    phases = {ph: (phases_after[ph][0] - phases_before[ph][0]) / pulls[1] * 1e3 for ph in PULL_PHASES}
    assert all(phases_after[ph][1] - phases_before[ph][1] == pulls[1] for ph in ("queued", "report")), (phases_before, phases_after)
    if seed == 0:
        # 256-token prompts: two 128-token blocks each, every one read from P (seed 0's prompts share
        # no block). vLLM's random prompts are runs of consecutive token ids from a random start, so
        # another seed's may share a block with one D has seen: then it loads less.
        assert received_bytes(openai_pd.d_metrics) - before == 32 * blocks(256) * LAYERS * BYTES_PER_BLOCK_PER_LAYER
        assert pulls[1] == 32, pulls
    medians = {f"pull_{ph}_p50": _median_bound_ms(phases_before[ph], phases_after[ph]) for ph in PULL_PHASES}
    proxy = _proxy_timings(url, skip)
    return pd, {**proxy, **_engine_parts(openai_pd.prefill.url, openai_pd.decode.url, engines_before, proxy),
                "pull": pulls[0] / pulls[1] * 1e3, **{f"pull_{ph}": v for ph, v in phases.items()}, **medians}


def _print_rows(rows: dict[str, dict], parts: dict[str, dict[str, float]]) -> None:
    print("\nvllm bench serve, 32 prompts x 256 tokens, 16 out, concurrency 4 (ms):")
    for name, r in rows.items():
        print(f"  {name:16} TTFT median {r['median_ttft_ms']:7.1f} p99 {r['p99_ttft_ms']:7.1f}   ITL median {r['median_itl_ms']:5.1f} p99 {r['p99_itl_ms']:6.1f}")
    print("where P/D's time to first token goes, medians at the proxy (ms):")
    for name, part in parts.items():
        pull = f"   of which kvd's pull {part['pull']:.1f} (D's daemon, mean)" if "pull" in part else ""
        print(f"  {name:16} prefill {part['prefill']:7.1f}   decode to first token {part['decode_first']:7.1f}{pull}")
        if "pull_plan" in part:
            print(f"  {'':16} D's pull by phase, mean (median at most): "
                  + ", ".join(f"{ph} {part['pull_' + ph]:.2f} ({part['pull_' + ph + '_p50']})" for ph in PULL_PHASES))
        if "d_ttft" in part:
            pull = f" (kvd's pull {part['pull']:.1f} of it)" if "pull" in part else ""
            print(f"  {'':16} by vLLM's own clocks, means: P: prefill to its end {part['p_e2e']:.1f}, HTTP and proxy {part['p_http']:.1f};"
                  f" D: arrival {part['d_arrival']:.1f}, queued until its KV came {part['d_queued']:.1f}{pull},"
                  f" first token {part['d_first_token']:.1f}, HTTP and proxy {part['d_http']:.1f}")


def test_vllm_bench_serve_through_a_plain_proxy_has_no_failures(openai_pd, vllm_python, model_dir, tmp_path):
    """A real client's load (vLLM's own ``vllm bench serve``) through P/D and
    the kvd-agnostic proxy: every request completes, and D loaded every
    prompt through kvd. The figures beside NIXL's and one engine's are
    ``pytest -m latency`` (below)."""
    pd, parts = _kvd_pd_bench(openai_pd, vllm_python, model_dir, tmp_path, seed=0)
    _print_rows({"P/D through kvd": pd}, {"P/D through kvd": parts})
    # Where the time to first token went, by vLLM's own clocks: each part present and computed.
    for k in ("p_e2e", "p_http", "d_ttft", "d_arrival", "d_queued", "d_first_token", "d_http"):
        assert math.isfinite(parts[k]), (k, parts)
    assert parts["d_queued"] > 0 and parts["d_first_token"] > 0, parts


IDLE_ROUNDS = 4  # of the idle connector against one engine, in turns
PD_ROUNDS = 3  # of kvd's P/D, NIXL's and one engine, in turns


def _delay_histogram(metrics_url: str) -> tuple[float, ...]:
    """P's kvd_publish_delay_seconds{by=engine} so far: (sum, count, cumulative buckets at PHASE_BOUNDS)."""
    return (scrape(metrics_url, "kvd_publish_delay_seconds_sum", by="engine"), scrape(metrics_url, "kvd_publish_delay_seconds_count", by="engine"),
            *(scrape(metrics_url, "kvd_publish_delay_seconds_bucket", by="engine", le=le) for le in PHASE_BOUNDS))


def _cpu_seconds(procs: list[subprocess.Popen]) -> float:
    """CPU seconds used so far by these processes' groups (a vLLM server's engine and workers are its children)."""
    groups = {p.pid for p in procs}
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) in groups:  # the process group: field 5 of stat
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _signal_groups(procs: list[subprocess.Popen], sig: signal.Signals) -> None:
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)


@pytest.mark.latency
def test_real_engine_latency_against_nixl_and_one_engine(openai_pd, vllm_python, model_dir, tmp_path):
    """The real-engine latency bench (``pytest -m latency``; not in ``make
    test``: a benchmark, about 10 minutes). First where kvd P/D's time to
    first token goes. Then kvd's P/D, vLLM's NixlConnector P/D (the same
    engines, cores and proxy) and one plain engine, all up at once, take
    turns for PD_ROUNDS rounds, each round its own prompts: P/D's TTFT over
    one engine's is each connector's cost, and P's publication delay after
    the forward (kvd_publish_delay_seconds) is read over the same rounds.
    Last, one engine against itself with an idle KvdConnector. Every row
    completes every request; figures are printed, not asserted."""
    pd, kvd_parts = _kvd_pd_bench(openai_pd, vllm_python, model_dir, tmp_path, seed=1)
    rows, parts = {"P/D through kvd": pd}, {"P/D through kvd": kvd_parts}
    urls = {"P/D through kvd": openai_pd.proxy([str(vllm_python), str(REPO / "tests" / "generic_pd_proxy.py")], tmp_path / "rounds-proxy.log")}
    nixl, why = vllm_env.nixl_overlay()
    nixl_pair = None
    # One plain engine, and the same engine with the connector loaded but moving
    # nothing (kv_both, its daemon up): what the connector costs every step.
    idle = Daemons(tmp_path / "idle")
    (tmp_path / "idle").mkdir()
    engines: dict[str, Server] = {}
    ratios: list[tuple[float, float]] = []
    excess: dict[str, list[float]] = {}
    try:
        if nixl is None:
            print(f"\nNIXL NOT MEASURED: {why}")
        else:
            nixl_pair = nixl_pd(vllm_python, model_dir, tmp_path, nixl)
            nixl_url = nixl_pair.proxy([str(vllm_python), str(REPO / "tests" / "generic_pd_proxy.py")], tmp_path / "nixl-proxy.log")
            try:
                nixl_skip = _warm(nixl_url, model_dir)
            except StreamError:
                # The peer's own engine died (seen: vLLM's AMX CPU attention raising
                # SIGILL in NixlConnector's engines only): the row is missing, said why.
                died = [line for log in nixl_pair.logs for line in log.read_text().splitlines() if "Fatal Python error" in line or "died" in line]
                print(f"\nNIXL NOT MEASURED: its engines failed their first request: {died[:3]}")
            else:
                engines_before = (_engine_times(nixl_pair.prefill.url), _engine_times(nixl_pair.decode.url))
                rows["P/D through NIXL"] = _bench_serve(vllm_python, nixl_url, model_dir, tmp_path / "nixl.json", tmp_path / "bench-nixl.log", 1)
                proxy = _proxy_timings(nixl_url, nixl_skip)
                parts["P/D through NIXL"] = {**proxy, **_engine_parts(nixl_pair.prefill.url, nixl_pair.decode.url, engines_before, proxy)}
                assert (rows["P/D through NIXL"]["completed"], rows["P/D through NIXL"].get("failed", 0)) == (32, 0), rows["P/D through NIXL"]
                urls["P/D through NIXL"] = nixl_url
        both = {"kv_connector": "KvdConnector", "kv_connector_module_path": "kvd.integrations.vllm", "kv_role": "kv_both",
                "kv_connector_extra_config": {"kvd_address": idle.start("idle").grpc}}
        for name, extra in (("one engine", ()), ("+ idle connector", ("--kv-transfer-config", json.dumps(both)))):
            engines[name] = serve(vllm_python, model_dir, tmp_path / f"{name[:3]}-server.log", *extra)
        for server in engines.values():
            wait_http(f"{server.url}/health", server.proc, 300, server.log)
            complete(server.url, model_dir, WARM_PROMPT)  # warm
        urls["one engine"] = engines["one engine"].url
        # What each server uses while the others are measured: an engine that spins when idle taxes every row.
        everyone = {"P/D through kvd": openai_pd.procs, "P/D through NIXL": nixl_pair.procs if nixl_pair else [],
                    "one engine": [e.proc for e in engines.values()]}
        cpu_before = {k: _cpu_seconds(v) for k, v in everyone.items()}
        time.sleep(10)
        idle_cpu = {k: (_cpu_seconds(v) - cpu_before[k]) * 10 for k, v in everyone.items()}
        print("\nCPU while idle, 10 s: " + ", ".join(f"{k} {c:.0f}%" for k, c in idle_cpu.items()))
        # NIXL's engines keep both cores busy while idle (its UCX progress): a row
        # measured beside them would pay for that. Each pair that spins is stopped
        # (SIGSTOP) while another row is measured, and runs only for its own.
        spinning = [k for k, c in idle_cpu.items() if c > 25 and k != "one engine"]  # the engines alone have rounds of their own after
        _signal_groups([p for k in spinning for p in everyone[k]], signal.SIGSTOP)
        delays_before = _delay_histogram(openai_pd.p_metrics)
        medians: dict[str, list[float]] = {name: [] for name in urls}
        for r in range(PD_ROUNDS):
            for name in (list(urls) if r % 2 == 0 else list(urls)[::-1]):
                mine = everyone[name] if name in spinning else []
                _signal_groups(mine, signal.SIGCONT)
                try:
                    slug = f"{r}-{name.split()[-1]}"
                    got = _bench_serve(vllm_python, urls[name], model_dir, tmp_path / f"round-{slug}.json", tmp_path / f"bench-round-{slug}.log", 20 + r)
                finally:
                    _signal_groups(mine, signal.SIGSTOP)
                assert (got["completed"], got.get("failed", 0)) == (32, 0), (name, got)
                medians[name].append(got["median_ttft_ms"])
        for name in urls:
            if name != "one engine":
                excess[name] = [m - one for m, one in zip(medians[name], medians["one engine"], strict=True)]
        delays_after = _delay_histogram(openai_pd.p_metrics)
        # One engine against itself with the idle connector, in turns (ABBA) for IDLE_ROUNDS
        # rounds: one sample each way says nothing of a 5% target on a machine whose speed
        # swings more than that between minutes.
        for r in range(IDLE_ROUNDS):
            got = {}
            # Each round its own prompts (a seed), the same for both engines.
            for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                got[name] = _bench_serve(vllm_python, engines[name].url, model_dir, tmp_path / f"{name[:3]}-{r}.json", tmp_path / f"bench-{name[:3]}-{r}.log", 1 + r)
                assert (got[name]["completed"], got[name].get("failed", 0)) == (32, 0), got[name]
            plain, conn = got["one engine"], got["+ idle connector"]
            ratios.append((conn["median_ttft_ms"] / plain["median_ttft_ms"], conn["median_itl_ms"] / plain["median_itl_ms"]))
            rows.update(got)  # the table shows the last round
    finally:
        for server in engines.values():
            kill_group(server.proc)
        # A stopped process takes its SIGTERM only once it runs.
        _signal_groups([*openai_pd.procs, *(nixl_pair.procs if nixl_pair else [])], signal.SIGCONT)
        for proc in nixl_pair.procs if nixl_pair else ():
            kill_group(proc)
        idle.kill_all()
    _print_rows(rows, parts)
    print(f"  idle connector / one engine, each of {IDLE_ROUNDS} rounds (target <= 1.05): TTFT median "
          + ", ".join(f"{t:.2f}" for t, _ in ratios) + "; ITL median " + ", ".join(f"{i:.2f}" for _, i in ratios)
          + f"; worst {max(t for t, _ in ratios):.2f} and {max(i for _, i in ratios):.2f}")
    print(f"alternated rounds ({PD_ROUNDS}), TTFT median (ms) each round: "
          + "; ".join(f"{name} " + " ".join(f"{m:.1f}" for m in ms) for name, ms in medians.items()))
    for name, ex in excess.items():
        print(f"  {name} TTFT over one engine's (ms), each round: " + " ".join(f"{e:.1f}" for e in ex) + f"; worst {max(ex):.1f}")
    if len(excess) == 2:
        k, n = excess["P/D through kvd"], excess["P/D through NIXL"]
        print("  kvd / NIXL, P/D TTFT over one engine's, each round (target <= 1/1.5): " + " ".join(f"{a / b:.2f}" if b > 0 else "-" for a, b in zip(k, n, strict=True)))
    if "P/D through NIXL" in rows:
        kvd, other = rows["P/D through kvd"], rows["P/D through NIXL"]
        for figure in ("median_ttft_ms", "median_itl_ms"):
            print(f"  kvd / NIXL {figure}, the first run: {kvd[figure] / other[figure]:.2f} (target <= 1)")
    count = delays_after[1] - delays_before[1]
    if count:
        print(f"P's publication after the forward that computed the prompt (kvd_publish_delay_seconds, {count:.0f} requests over the rounds): "
              f"mean {(delays_after[0] - delays_before[0]) / count * 1e3:.2f} ms, median at most {_median_bound_ms(delays_before, delays_after)} ms (target <= 5)")
