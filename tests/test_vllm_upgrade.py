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

import signal
import sys
import time
from pathlib import Path

import pytest

from kvd.client import daemon_status
from kvd.testing.daemons import DaemonProc
from tests.conftest import scrape, wait_for
from tests.vllm_support import complete_pd, openai_pd_servers, prefill_alone

# As the README says to run D: a load that fails (a sidecar restart fails what was in flight) is recomputed.
RECOMPUTE = {"kv_load_failure_policy": "recompute"}

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


def _held(metrics_url: str) -> str:
    """P's publications holding blocks, for the log: a scrape that fails says so and does not fail the test."""
    try:
        return f"{scrape(metrics_url, 'kvd_leases_held'):.0f}"
    except Exception as e:
        return f"? ({e})"


def _received(d: DaemonProc) -> float:
    """The bytes D's daemon received over TCP. Its /metrics not answering fails the test with the
    evidence CI would otherwise lose: whether a second, patient scrape is answered, and (for a daemon
    of this tree) where each of its threads is."""
    try:
        return scrape(d.metrics_url, "kvd_received_bytes_total", transport="tcp")
    except OSError as e:
        t0 = time.monotonic()
        try:
            scrape(d.metrics_url, "kvd_received_bytes_total", timeout=30, transport="tcp")
            again = f"answered {time.monotonic() - t0:.1f}s later"
        except OSError as e2:
            again = f"not answered within 30 s either ({e2})"
        stacks = d.stacks()  # none asked of the previous release's daemon
        raise AssertionError(f"{d.engine_id}'s /metrics did not answer within 5 s ({e}); a second scrape {again}; "
                             f"its threads:\n{stacks[-8000:]}\nits log ends:\n{d.log()[-3000:]}") from e


def _kvd_lines(tmp: Path, last: int = 60) -> str:
    """The connectors' own lines (not vLLM's request log) from each server's log, the last ``last`` of each."""
    out = []
    for log in sorted(tmp.glob("*-server.log")):
        lines = [line[:300] for line in log.read_text(errors="replace").splitlines() if "kvd" in line and "HTTP" not in line]
        out.append(f"--- {log.name}\n" + "\n".join(lines[-last:]))
    return "\n".join(out)


def test_each_sidecar_replaced_by_the_previous_release_and_back_under_a_steady_load(vllm_python, model_dir, previous, tmp_path):
    """A steady load (one request after another through the proxy) while each
    daemon in turn is drained and replaced by the previous release, then by
    this one: per phase, how many requests, how many loaded through kvd, and
    none failed or answered other tokens than one engine's."""
    import threading

    version, tree = previous
    with openai_pd_servers(vllm_python, model_dir, tmp_path, connector=RECOMPUTE, replaceable=True, health_timeout=600) as pd:
        assert pd.sidecars is not None
        daemons = pd.sidecars.current
        url = pd.proxy([sys.executable, "-m", "kvd", "proxy"], tmp_path / "proxy.log")
        phase = ["both current"]
        rows: dict[str, dict[str, int]] = {}
        slow: list[str] = []  # requests that took over 5 s: when, in which phase, and how long
        stop = threading.Event()
        t_start = time.monotonic()

        def load() -> None:
            i = 0
            while not stop.is_set():  # a new prompt each time: D never holds it, so it must load it
                prompt = [(11 * i + 5 * j) % 997 + 3 for j in range(140 + 7 * (i % 20))]
                i += 1
                t0, began = time.monotonic(), phase[0]
                want = prefill_alone(pd.prefill.url, model_dir, prompt)  # one engine: P asked plainly
                t1 = time.monotonic()
                row = rows.setdefault(phase[0], {"requests": 0, "failed": 0, "wrong": 0})
                row["requests"] += 1
                try:
                    if complete_pd(pd, url, model_dir, prompt) != want:
                        row["wrong"] += 1
                except AssertionError:
                    row["failed"] += 1
                if (t2 := time.monotonic()) - t0 > 5:
                    slow.append(f"request {i - 1} at {t0 - t_start:.1f}s ({began}): P alone {t1 - t0:.1f}s, P/D {t2 - t1:.1f}s")

        loader = threading.Thread(target=load)
        loader.start()
        time.sleep(10)
        loaded: dict[str, float] = {}
        for role in ("decode", "prefill"):
            for source, label in ((tree, version), (None, "current")):
                old = daemons[role]
                phase[0] = f"{role} draining"
                print(f"{time.monotonic() - t_start:.1f}s: {phase[0]}; P holds {_held(daemons['prefill'].metrics_url)} publications")
                t_stop = time.monotonic()
                old.stop(signal.SIGTERM)  # drains: in-flight work finishes or is refused, then exit 0
                t_started = time.monotonic()
                assert old.proc.returncode == 0, old.log()[-2000:]
                new = pd.sidecars.replace(role, source)
                if source:
                    assert daemon_status(new.grpc).version == version
                new.info  # noqa: B018 (waits for its ready file)
                t_ready = time.monotonic()
                took = _rejoined(new.grpc)
                print(f"the old daemon exited {t_started - t_stop:.1f}s after SIGTERM; the new one was ready {t_ready - t_started:.1f}s later")
                phase[0] = name = f"{role} on {label} (worker rejoined in {took:.1f}s)"
                print(f"{time.monotonic() - t_start:.1f}s: {name}; P holds {_held(daemons['prefill'].metrics_url)} publications")
                before = received = _received(daemons["decode"])
                t_phase = time.monotonic()
                # 12 s of load a phase; longer (up to 60 s) until a load went through kvd: a request takes seconds here,
                # and the first after a replacement may be recomputed.
                while (waited := time.monotonic() - t_phase) < 12 or (received == before and waited < 60):
                    time.sleep(0.5)
                    received = _received(daemons["decode"])
                loaded[name] = received - before
        # P's scheduler publishes for the engine again once P's worker is back with a current daemon (it kept the
        # token the scheduler learned at startup; the previous release issued it another one meanwhile, so the
        # scheduler was refused and paused): within its retry pause and a request, while the load goes on.
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and not _published_again(pd.prefill.log.read_text(errors="replace")):
            time.sleep(1)
        stop.set()
        loader.join(timeout=300)
        print("\n" + "\n".join(f"{k}: {v}" for k, v in rows.items()))
    assert all(r["failed"] == 0 and r["wrong"] == 0 for r in rows.values()), rows
    assert sum(r["requests"] for r in rows.values()) >= 10, rows
    # The new daemons took part: D's (whichever version) received KV through kvd in every phase after a replacement.
    # CI keeps no files: a phase without kvd loads says what the connectors logged.
    assert all(v > 0 for v in loaded.values()), (loaded, slow, _kvd_lines(tmp_path))
    assert _published_again(pd.prefill.log.read_text(errors="replace")), pd.prefill.log.read_text(errors="replace")[-3000:]


def test_p_frees_what_d_could_not_load_while_its_daemon_was_down_once_it_is_back(vllm_python, model_dir, tmp_path):
    """D's sidecar down (drained, not yet replaced): every request D gets is
    recomputed, and each P published stays held, pinning P's blocks, until its
    lease (120 s by default) unless D says it will not read it. Under a steady
    load that filled P's cache within a sidecar restart. Once D's worker
    registered again, it releases them: P holds none within seconds."""
    with openai_pd_servers(vllm_python, model_dir, tmp_path, connector=RECOMPUTE, replaceable=True, health_timeout=600) as pd:
        assert pd.sidecars is not None
        daemons = pd.sidecars.current
        url = pd.proxy([sys.executable, "-m", "kvd", "proxy"], tmp_path / "proxy.log")
        p_metrics = daemons["prefill"].metrics_url

        def prompt(i: int) -> list[int]:
            return [(13 * i + 7 * j) % 991 + 5 for j in range(150 + 9 * i)]

        assert complete_pd(pd, url, model_dir, prompt(0)) == prefill_alone(pd.prefill.url, model_dir, prompt(0))
        wait_for(lambda: scrape(p_metrics, "kvd_leases_held") == 0, 30, "D read the first request and P still holds it")
        assert daemons["decode"].stop(signal.SIGTERM) == 0
        n = 8
        for i in range(1, n + 1):  # D recomputes each: its daemon is down
            assert complete_pd(pd, url, model_dir, prompt(i)) == prefill_alone(pd.prefill.url, model_dir, prompt(i))
        held = scrape(p_metrics, "kvd_leases_held")
        assert held == n, f"P holds {held} publications for the {n} requests D could not load"
        released = scrape(p_metrics, "kvd_reader_releases_total")
        pd.sidecars.replace("decode")
        took = _rejoined(daemons["decode"].grpc)
        t0 = time.monotonic()
        wait_for(lambda: scrape(p_metrics, "kvd_leases_held") == 0, 30, "P still holds publications 30 s after D's worker registered again")
        print(f"\nD's worker registered again {took:.1f}s after its daemon started; P held none {time.monotonic() - t0:.1f}s later")
        assert scrape(p_metrics, "kvd_reader_releases_total") - released == n  # released by D, not expired
        # And D loads through kvd again (a fresh prompt each try: D recomputed, and now holds, the ones before).
        before = scrape(daemons["decode"].metrics_url, "kvd_received_bytes_total", transport="tcp")
        for i in range(n + 1, n + 20):
            assert complete_pd(pd, url, model_dir, prompt(i)) == prefill_alone(pd.prefill.url, model_dir, prompt(i))
            if scrape(daemons["decode"].metrics_url, "kvd_received_bytes_total", transport="tcp") > before:
                break
        else:
            raise AssertionError("D did not load through kvd again")
