"""One config model: file < environment < flags, validated with one clear line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvd.daemon import config
from kvd.integrations.kv_params import release_params, stream_params
from tests.conftest import REPO, make_worker, scrape, transfer


def test_precedence_file_then_env_then_flags(tmp_path):
    f = tmp_path / "kvd.yaml"
    f.write_text("engine_id: from-file\nlease_seconds: 30\ngrpc_port: 6000\ndata_port: 6001\n")
    c = config.load(str(f), env={"KVD_LEASE_SECONDS": "45", "KVD_GRPC_PORT": "7000"}, flags={"grpc_port": "8000", "data_port": None})
    assert (c.engine_id, c.lease_seconds, c.grpc_port, c.data_port) == ("from-file", 45.0, 8000, 6001)


@pytest.mark.parametrize(
    "text, env, flags, message",
    [
        ("engine_id: p\nlease_seconds: -1\n", {}, {}, "lease_seconds=-1.0 (from {f}) must be in (0, 86400]"),
        ("engine_id: p\n", {"KVD_LEASE_SECONDS": "inf"}, {}, "lease_seconds=inf (from KVD_LEASE_SECONDS) must be in (0, 86400]"),
        ("engine_id: p\n", {}, {"stall_timeout_seconds": "inf"}, "stall_timeout_seconds=inf (from --stall-timeout-seconds) must be at most 86400 (a day)"),
        ("engine_id: p\ndrain_report_seconds: 1e12\n", {}, {}, "drain_report_seconds=1000000000000.0 (from {f}) must be at most 86400 (a day)"),
        ("engine_id: p\n", {"KVD_GRPC_PORT": "http"}, {}, "grpc_port='http' (from KVD_GRPC_PORT) is not a valid int"),
        ("engine_id: p\n", {}, {"same_host": "maybe"}, "same_host='maybe' (from --same-host) must be auto or off"),
        ("engine_id: p\nbogus: 1\n", {}, {}, "bogus (from {f}) is not a config key"),
        ("engine_id: 'bad id'\n", {}, {}, "engine_id='bad id' (from {f})"),
        ("lease_seconds: 1\n", {}, {}, "engine_id is required"),
        ("[1, 2]\n", {}, {}, "must be a mapping"),
    ],
)
def test_a_wrong_value_is_one_line_naming_the_key(tmp_path, text, env, flags, message):
    f = tmp_path / "kvd.yaml"
    f.write_text(text)
    with pytest.raises(config.ConfigError) as e:
        config.load(str(f), env=env, flags=flags)
    assert message.format(f=f) in str(e.value)
    assert "\n" not in str(e.value)


def test_serve_reports_config_errors_and_prints_the_effective_config(tmp_path):
    f = tmp_path / "kvd.yaml"
    f.write_text("engine_id: p\nmetrics_port: 99999\n")
    r = subprocess.run([sys.executable, "-m", "kvd", "serve", "--config", str(f)], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == f"kvd: config error: metrics_port=99999 (from {f}) must be a port in [0, 65535], or -1 for none"
    r = subprocess.run([sys.executable, "-m", "kvd", "serve", "--config", str(f), "--metrics-port", "9500", "--print-config"],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0 and "metrics_port: 9500" in r.stdout and "engine_id: p" in r.stdout


def test_status_table_and_json(daemons):
    d = daemons.start("decode")
    make_worker(d.grpc, "decode")
    r = subprocess.run([sys.executable, "-m", "kvd", "status", d.grpc], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    for heading in ("workers", "leases (0)", "pinned ranks: 0", "pulls in flight (0)", "recent failures", "tp0/1 pp0/1"):
        assert heading in r.stdout
    r = subprocess.run([sys.executable, "-m", "kvd", "status", d.grpc, "--json"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert json.loads(r.stdout)["engineId"] == "decode"


def test_status_and_help_answer_without_loading_torch(daemons):
    """An operator's `kvd status` and `kvd --help` must not pay for importing
    torch (2 s here); `kvd bench --help` does load it (the control)."""
    d = daemons.start("decode")
    code = "import sys\nfrom kvd.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\nprint('torch loaded:', 'torch' in sys.modules)"
    for argv, loads, shows in ((["status", d.grpc], False, "pinned ranks: 0"), (["--help"], False, "status"), (["bench", "--help"], True, "--sections")):
        r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=REPO, timeout=60)
        assert f"torch loaded: {loads}" in r.stdout and shows in r.stdout, (argv, r.stdout[-500:], r.stderr[-2000:])


def test_json_logs_are_one_object_a_line(daemons):
    d = daemons.start("decode", "--log-format", "json")
    make_worker(d.grpc, "decode")
    d.stop()
    lines = [json.loads(line) for line in d.log().splitlines() if line.startswith("{")]
    serving = next(x for x in lines if x["msg"] == "kvd serving")
    assert serving["engine_id"] == "decode" and serving["level"] == "info"
    assert any(x["msg"] == "registered" and x["worker"].startswith("decode") for x in lines)


def test_every_cli_option_says_what_it_is(monkeypatch, capsys):
    import argparse

    from kvd import cli

    seen: list[argparse.Action] = []
    add = argparse._ActionsContainer.add_argument

    def record(self, *args, **kwargs):
        action = add(self, *args, **kwargs)
        seen.append(action)
        return action

    monkeypatch.setattr(argparse._ActionsContainer, "add_argument", record)
    for command in ("serve", "demo", "bench", "proxy", "status"):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
    assert len(seen) > 80
    assert [a.option_strings or a.dest for a in seen if not a.help] == []


@pytest.mark.parametrize(("argv", "message"), [
    (["demo", "--requests", "0"], "kvd demo: error: argument --requests: must be at least 1, got 0"),
    (["demo", "--block-size", "0"], "kvd demo: error: argument --block-size: must be at least 1, got 0"),
    (["demo", "--min-tokens", "100", "--max-tokens", "10"], "kvd demo: --min-tokens=100 must be at most --max-tokens=10"),
    (["bench", "--load-seconds", "inf"], "kvd bench: error: argument --load-seconds: must be a finite number above 0, got inf"),
    (["proxy", "--prefill", "http://a:1", "--decode", "http://b:2", "--port", "70000"],
     "kvd proxy: error: argument --port: must be in [0, 65535], got 70000"),
])
def test_a_bad_tool_option_is_one_line_naming_it(argv, message):
    """Before, these were tracebacks (ZeroDivisionError, bind's OverflowError,
    randrange's ValueError) or a demo of 0 requests that reported success."""
    r = subprocess.run([sys.executable, "-m", "kvd", *argv], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2 if "error: argument" in message else r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines()[-1] == message and "Traceback" not in r.stderr


@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_daemons_on_an_ipv6_host_serve_and_move_blocks_exactly(daemons, host):
    """An IPv6 host, bare or bracketed, binds gRPC, the data plane and /metrics, and every address the
    daemons give out is host:port text with the host in brackets; a vLLM param's bare remote_host comes
    back as the same address. Negative control: gRPC was given '::1:0' and the daemon exited 1
    ('Failed to bind to address ::1:0')."""
    p, d = daemons.start("prefill", "--host", host), daemons.start("decode", "--host", host)
    for info in (p.info, d.info):
        assert all(info[k].startswith("[::1]:") for k in ("grpc", "data", "data_bind", "metrics")), info
    pw, dw = make_worker(p.grpc, "prefill"), make_worker(d.grpc, "decode")  # registers over ::1: the caller's uid is found
    _, finished = transfer([pw], [dw], "v6", 5, [1, 2], [3, 4], 32)
    assert finished[0].details[("recving", "v6")].outcome == "done" and dw.mismatch(5, [3, 4], 32) is None
    assert scrape(d.metrics_url, "kvd_received_bytes_total", transport="tcp") > 0
    _, decode = stream_params(name="v6", capability=bytes(16), engine_id="prefill", address=p.grpc)
    assert decode["remote_host"] == "::1" and release_params(decode).remote_address == p.grpc
