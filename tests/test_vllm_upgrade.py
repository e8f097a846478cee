"""Upgrading a sidecar under a live engine (``pytest -m "vllm and upgrade"``).

Two OpenAI servers, each beside its own ``kvd serve``, behind ``kvd proxy``.
Each daemon in turn is drained with SIGTERM and replaced on the same port by
the previous release (from CHANGELOG.md, checked out from git), then by this
one again, while the engines keep running: the connector sees its daemon
go, fails what was in flight (vLLM recomputes it), registers its caches
again with the new daemon, and loads go through kvd again. Every answer is
one engine's tokens; none is lost.
"""

from __future__ import annotations

import json
import signal
import sys
import time

import pytest

from kvd.client import daemon_status
from tests.conftest import Daemons, free_port, scrape
from tests.vllm_support import OpenAIPD, complete_pd, kill_group, prefill_alone, serve, wait_http

pytestmark = [pytest.mark.vllm, pytest.mark.upgrade, pytest.mark.slow, pytest.mark.timeout(1800)]


def _rejoined(address: str, timeout: float = 60) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if len(daemon_status(address).workers) == 1:
                return time.monotonic() - t0
        except Exception:
            pass
        time.sleep(0.2)
    raise AssertionError(f"no worker registered again with the daemon at {address} within {timeout}s")


def _published_again(p_log: str) -> bool:
    """P's scheduler was refused (paused), and after that published for the engine again."""
    _, refused, after = p_log.rpartition("cannot publish for the engine")
    return bool(refused) and "publishes for the engine again" in after


def test_each_sidecar_replaced_by_the_previous_release_and_back_under_a_steady_load(vllm_python, model_dir, previous, tmp_path):
    """A steady load (one request after another through the proxy) while each
    daemon in turn is drained and replaced by the previous release, then by
    this one: per phase, how many requests, how many loaded through kvd, and
    none failed or answered other tokens than one engine's."""
    import threading

    version, tree = previous
    ds = Daemons(tmp_path)
    ports = {"prefill": free_port(), "decode": free_port()}
    daemons = {role: ds.start(role, grpc_port=ports[role]) for role in ports}
    servers, procs = {}, []
    try:
        for role, cpus in (("prefill", "0"), ("decode", "1")):
            config = {"kv_connector": "KvdConnector", "kv_connector_module_path": "kvd.integrations.vllm", "kv_load_failure_policy": "recompute",
                      "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
                      "kv_connector_extra_config": {"kvd_address": daemons[role].grpc}}
            servers[role] = serve(vllm_python, model_dir, tmp_path / f"{role}-server.log", "--kv-transfer-config", json.dumps(config), cpus=cpus)
            procs.append(servers[role].proc)
        for s in servers.values():
            wait_http(f"{s.url}/health", s.proc, 600, s.log)
        pd = OpenAIPD(servers["prefill"], servers["decode"], daemons["decode"].metrics_url, daemons["prefill"].grpc, "", procs,
                      [s.log for s in servers.values()])
        url = pd.proxy([sys.executable, "-m", "kvd", "proxy"], tmp_path / "proxy.log")
        phase = ["both current"]
        rows: dict[str, dict[str, int]] = {}
        stop = threading.Event()

        def load() -> None:
            i = 0
            while not stop.is_set():  # a new prompt each time: D never holds it, so it must load it
                prompt = [(11 * i + 5 * j) % 997 + 3 for j in range(140 + 7 * (i % 20))]
                i += 1
                want = prefill_alone(pd.prefill.url, model_dir, prompt)  # one engine: P asked plainly
                row = rows.setdefault(phase[0], {"requests": 0, "failed": 0, "wrong": 0})
                row["requests"] += 1
                try:
                    if complete_pd(pd, url, model_dir, prompt) != want:
                        row["wrong"] += 1
                except AssertionError:
                    row["failed"] += 1

        loader = threading.Thread(target=load)
        loader.start()
        time.sleep(10)
        loaded: dict[str, float] = {}
        for role in ("decode", "prefill"):
            for source, label in ((tree, version), (None, "current")):
                old = daemons[role]
                phase[0] = f"{role} draining"
                old.stop(signal.SIGTERM)  # drains: in-flight work finishes or is refused, then exit 0
                assert old.proc.returncode == 0, old.log()[-2000:]
                daemons[role] = new = ds.start(role, grpc_port=ports[role], **({"source": source} if source else {}))
                if source:
                    assert daemon_status(new.grpc).version == version
                took = _rejoined(new.grpc)
                phase[0] = name = f"{role} on {label} (worker rejoined in {took:.1f}s)"
                before = scrape(daemons["decode"].metrics_url, "kvd_received_bytes_total", transport="tcp")
                time.sleep(12)
                loaded[name] = scrape(daemons["decode"].metrics_url, "kvd_received_bytes_total", transport="tcp") - before
        # P's scheduler publishes for the engine again once P's worker is back with a current daemon (it kept the
        # token the scheduler learned at startup; the previous release issued it another one meanwhile, so the
        # scheduler was refused and paused): within its retry pause and a request, while the load goes on.
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and not _published_again(servers["prefill"].log.read_text(errors="replace")):
            time.sleep(1)
        stop.set()
        loader.join(timeout=300)
        print("\n" + "\n".join(f"{k}: {v}" for k, v in rows.items()))
    finally:
        for proc in procs:
            kill_group(proc)
        ds.kill_all()
    assert all(r["failed"] == 0 and r["wrong"] == 0 for r in rows.values()), rows
    assert sum(r["requests"] for r in rows.values()) >= 10, rows
    # The new daemons took part: D's (whichever version) received KV through kvd in every phase after a replacement.
    assert all(v > 0 for v in loaded.values()), loaded
    assert _published_again(servers["prefill"].log.read_text(errors="replace")), servers["prefill"].log.read_text(errors="replace")[-3000:]
