"""A real Prometheus server scrapes two daemons during a transfer."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from tests.conftest import free_port, make_worker


def prometheus_binary() -> str | None:
    found = shutil.which("prometheus")
    if found or os.geteuid() != 0 or not shutil.which("apt-get"):
        return found
    # CI machines start bare: install Debian's package (about 20 s).
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=300)
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "prometheus"], env=env, capture_output=True, timeout=600)
    return shutil.which("prometheus")


def query(base: str, expr: str) -> list[dict]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    body = json.loads(urllib.request.urlopen(url, timeout=5).read())
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.mark.slow
def test_real_prometheus_sees_the_bytes_moved(daemons, tmp_path):
    binary = prometheus_binary()
    if binary is None:
        pytest.skip("SKIPPED LOUDLY: Debian's prometheus package could not be installed here (needs root and apt)")
    p, d = daemons.start("prefill"), daemons.start("decode")
    port = free_port()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(json.dumps({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [{"job_name": "kvd", "static_configs": [{"targets": [p.info["metrics"], d.info["metrics"]]}]}],
    }))
    prom = subprocess.Popen([binary, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        pw, dw = make_worker(p.grpc, "prefill"), make_worker(d.grpc, "decode")
        moved = 0
        for i in range(5):
            ids = list(range(1 + 4 * i, 5 + 4 * i))
            params = pw.client.publish(f"r{i}", [ids], 64)
            dw.client.pull(f"r{i}", params, [ids])
            f = dw.client.wait_finished(recving={f"r{i}"})
            moved += f.details[("recving", f"r{i}")].bytes
        assert moved > 0
        deadline = time.monotonic() + 60
        received = sent = -1.0
        while time.monotonic() < deadline:
            try:
                up = query(base, 'up{job="kvd"}')
                r = query(base, 'sum(kvd_received_bytes_total{job="kvd"})')
                s_ = query(base, 'sum(kvd_sent_bytes_total{job="kvd"})')
            except OSError:
                time.sleep(0.5)
                continue
            received = float(r[0]["value"][1]) if r else -1.0
            sent = float(s_[0]["value"][1]) if s_ else -1.0
            if len(up) == 2 and all(x["value"][1] == "1" for x in up) and received == moved and sent == moved:
                break
            time.sleep(0.5)
        assert received == moved, f"Prometheus saw {received} received bytes, the transfer moved {moved}"
        assert sent == moved, f"Prometheus saw {sent} sent bytes, the transfer moved {moved}"
        assert len(up) == 2 and all(x["value"][1] == "1" for x in up), up
    finally:
        prom.terminate()
        prom.wait(timeout=30)
