"""deploy/ and the Dockerfile: manifests validate offline, the chart renders,
and every metric a dashboard or alert uses is one kvd exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvd.daemon.metrics import Metrics

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
K8S_VERSION = "1.30.0"
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}


SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",), "info": ("_info",), "summary": ("_sum", "_count", "")}


def exported_metric_names() -> set[str]:
    """Every series name kvd can export (labelled metrics have no samples until used)."""
    names = {"up"}  # Prometheus's own, for the down alert
    for family in Metrics().registry.collect():
        names |= {family.name + suffix for suffix in SUFFIXES[family.type]}
    return names


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(kvd_[a-z_]+|up)\b(?=\s*[{\[(]|\s*[=!<>]|\s*\)|$)", expr))


def validate_docs(docs: list[dict], where: str) -> None:
    kv = pytest.importorskip("kubernetes_validate")
    for doc in docs:
        if doc is None:
            continue
        if doc["kind"] in CRD_KINDS:
            # No schema ships for CRDs; check the shape we rely on.
            assert doc["apiVersion"] == "monitoring.coreos.com/v1", where
            assert doc["metadata"]["name"] and doc["spec"], where
            continue
        try:
            kv.validate(doc, K8S_VERSION, strict=True)
        except kv.ValidationError as e:
            raise AssertionError(f"{where}: {doc['kind']} {e.path}: {e.message}") from None


def test_kubernetes_manifests_validate_offline():
    files = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
    kinds = set()
    for f in files:
        docs = list(yaml.safe_load_all(f.read_text()))
        kinds |= {d["kind"] for d in docs if d}
        validate_docs(docs, str(f))
    assert {"DaemonSet", "Service", "ServiceMonitor", "PrometheusRule", "Pod"} <= kinds


def test_daemonset_probes_grpc_health_and_shares_shm():
    ds = yaml.safe_load((DEPLOY / "kubernetes" / "daemonset.yaml").read_text())
    pod = ds["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["livenessProbe"]["grpc"]["port"] == 50051 and c["readinessProbe"]["grpc"]["port"] == 50051
    assert pod["hostIPC"] is True
    assert any(v["name"] == "dshm" for v in pod["volumes"]) and c["resources"]["requests"]


def test_helm_chart_renders_and_validates():
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed")
    with helm.Chart.load(str(DEPLOY / "helm" / "kvd")) as chart:
        rendered = chart.render({}, name="test", namespace="kvd")
        without_monitoring = chart.render({"serviceMonitor": {"enabled": False}, "prometheusRule": {"enabled": False}}, name="t2", namespace="kvd")
    docs = [d for text in rendered.values() for d in yaml.safe_load_all(text) if d]
    assert {d["kind"] for d in docs} == {"DaemonSet", "Service", "ServiceMonitor", "PrometheusRule"}
    validate_docs(docs, "helm chart")
    kinds = {d["kind"] for text in without_monitoring.values() for d in yaml.safe_load_all(text) if d}
    assert kinds == {"DaemonSet", "Service"}


def test_dashboard_and_alerts_use_only_exported_metrics():
    exported = exported_metric_names()
    dash = json.loads((DEPLOY / "grafana" / "kvd-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for word in ("throughput", "latency", "failures", "leases", "in flight"):
        assert word in titles
    rules = yaml.safe_load((DEPLOY / "kubernetes" / "prometheusrule.yaml").read_text())
    exprs += [r["expr"] for g in rules["spec"]["groups"] for r in g["rules"]]
    used = set().union(*(metric_names(e) for e in exprs))
    assert used, "no metric names found"
    unknown = sorted(used - exported)
    assert not unknown, f"dashboard/alerts use metrics kvd does not export: {unknown}"


def test_alert_rules_pass_promtool_when_installed(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    rules = yaml.safe_load((DEPLOY / "kubernetes" / "prometheusrule.yaml").read_text())
    f = tmp_path / "rules.yaml"
    f.write_text(yaml.safe_dump({"groups": rules["spec"]["groups"]}))
    r = subprocess.run([promtool, "check", "rules", str(f)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_compose_runs_both_daemons_the_demo_and_prometheus():
    compose = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yaml").read_text())
    assert {"prefill", "decode", "demo", "prometheus"} <= set(compose["services"])
    scrape = yaml.safe_load((DEPLOY / "compose" / "prometheus.yml").read_text())
    assert set(scrape["scrape_configs"][0]["static_configs"][0]["targets"]) == {"prefill:9400", "decode:9400"}


def test_every_deploy_file_runs_the_image_the_dockerfile_builds_on_its_ports():
    """compose, the manifests and the chart name the image deploy/image-test builds and
    proves (kvd:<version>), and the ports the image's environment sets."""
    text = (REPO / "Dockerfile").read_text()
    version = re.search(r'org\.opencontainers\.image\.version="([^"]+)"', text).group(1)
    image = f"kvd:{version}"
    assert re.search(rf"^IMAGE={re.escape(image)}$", (DEPLOY / "image-test").read_text(), re.M)
    ports = {k: int(v) for k, v in re.findall(r"KVD_(GRPC|DATA|METRICS)_PORT=(\d+)", text)}
    assert ports == {"GRPC": 50051, "DATA": 50052, "METRICS": 9400}
    compose = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yaml").read_text())
    kvd_services = [s for name, s in compose["services"].items() if name != "prometheus"]
    assert all(s["image"] == image for s in kvd_services)
    assert compose["services"]["prefill"]["build"]["dockerfile"] == "Dockerfile"
    containers = []
    for f in ("daemonset.yaml", "engine-pod.yaml"):
        doc = yaml.safe_load((DEPLOY / "kubernetes" / f).read_text())
        pod = doc["spec"]["template"]["spec"] if doc["kind"] == "DaemonSet" else doc["spec"]
        containers += [c for c in pod["containers"] if c["image"].startswith("kvd:")]
    assert len(containers) == 2 and all(c["image"] == image for c in containers)
    for c in containers:
        assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": 50051, "data": 50052, "metrics": 9400}
    values = yaml.safe_load((DEPLOY / "helm" / "kvd" / "values.yaml").read_text())
    assert f"{values['image']['repository']}:{values['image']['tag']}" == image
    assert values["ports"] == {"grpc": 50051, "data": 50052, "metrics": 9400}


def test_dockerfile_is_multistage_nonroot_with_a_grpc_healthcheck():
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE=", text, re.M) and re.search(r"^FROM \$\{BASE\}", text, re.M)  # any base, same file
    assert len(re.findall(r"^FROM ", text, re.M)) >= 2
    assert re.search(r"^USER 10001", text, re.M)
    assert "HEALTHCHECK" in text and "kvd.healthcheck" in text
    assert "ARG VARIANT" in text and "torch==2.13.0" in text
    assert "-c constraints.txt" in text  # every runtime dependency pinned
    pins = (REPO / "constraints.txt").read_text().split()
    assert all("==" in line for line in pins) and any(line.startswith("grpcio==") for line in pins)
