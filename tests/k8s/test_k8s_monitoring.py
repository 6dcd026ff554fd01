"""Monitoring: PodMonitors for the operator, the dashboard and alert rules as one copy of the
compose files, and the plain Prometheus config accepted by `promtool check config`."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.k8s import checks as ck
from tests.k8s.manifests import DASHBOARDS, find, generated
from tests.k8s.renders import needs_kubectl, rendered

pytestmark = needs_kubectl

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not found (Prometheus' tool; Debian: apt install prometheus)"
)


def promtool_check(config_map: dict, folder: Path) -> subprocess.CompletedProcess[str]:
    """Write the ConfigMap's files as the pod sees them and run `promtool check config`."""
    for name, text in config_map.get("data", {}).items():
        (folder / name).write_text(text)
    return subprocess.run(
        [PROMTOOL, "check", "config", str(folder / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("name", ["monitoring", "overlay:xpyd", "router-lws-monitoring"])
def test_podmonitors(name: str) -> None:
    assert ck.check_podmonitors(rendered(name)) == []


@pytest.mark.parametrize("name", ["monitoring", "overlay:xpyd"])
def test_dashboard_configmap_is_the_compose_dashboard(name: str) -> None:
    assert ck.check_dashboards(rendered(name), DASHBOARDS) == []


@pytest.mark.parametrize("name", ["standalone-prometheus", "overlay:1p1d", "router-standalone"])
def test_plain_prometheus_config(name: str) -> None:
    assert ck.check_prometheus_config(rendered(name)) == []


@needs_promtool
@pytest.mark.parametrize("name", ["standalone-prometheus", "overlay:1p1d", "router-standalone"])
def test_promtool_accepts_the_config_and_rules(name: str, tmp_path: Path) -> None:
    cm = generated(rendered(name), "ConfigMap", "pcp-pd-prometheus-config")
    proc = promtool_check(cm, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout + proc.stderr
    assert "dns_sd_configs" in cm["data"]["prometheus.yml"]


# ------------------------------------------------------------------ the checks can fail


@needs_promtool
def test_promtool_rejects_a_broken_config(tmp_path: Path) -> None:
    cm = generated(rendered("standalone-prometheus"), "ConfigMap", "pcp-pd-prometheus-config")
    config = yaml.safe_load(cm["data"]["prometheus.yml"])
    config["scrape_configs"][0]["dns_sd_configs"][0]["type"] = "SRVX"
    cm["data"]["prometheus.yml"] = yaml.safe_dump(config)
    assert promtool_check(cm, tmp_path).returncode != 0


@needs_promtool
def test_promtool_rejects_broken_rules(tmp_path: Path) -> None:
    cm = generated(rendered("standalone-prometheus"), "ConfigMap", "pcp-pd-prometheus-config")
    cm["data"]["alerts.yml"] += "      - alert: Broken\n        expr: sum(\n"
    assert promtool_check(cm, tmp_path).returncode != 0


def test_prometheus_check_fails_on_an_unknown_service_or_port() -> None:
    objs = rendered("standalone-prometheus")
    cm = generated(objs, "ConfigMap", "pcp-pd-prometheus-config")
    text = cm["data"]["prometheus.yml"]
    cm["data"]["prometheus.yml"] = text.replace(
        "_http._tcp.pcp-pd-decode", "_api._tcp.pcp-pd-decode"
    )
    assert any("no port named api" in p for p in ck.check_prometheus_config(objs))
    # A fixed port is what broke with the router (prefill moves to 8000): refused.
    objs = rendered("router-standalone")
    cm = generated(objs, "ConfigMap", "pcp-pd-prometheus-config")
    config = yaml.safe_load(cm["data"]["prometheus.yml"])
    config["scrape_configs"][0]["dns_sd_configs"][0] = {
        "names": ["pcp-pd-prefill"],
        "type": "A",
        "port": 8100,
    }
    cm["data"]["prometheus.yml"] = yaml.safe_dump(config)
    assert any("not an SRV name" in p for p in ck.check_prometheus_config(objs))
    objs = rendered("standalone-prometheus")
    cm = generated(objs, "ConfigMap", "pcp-pd-prometheus-config")
    cm["data"]["alerts.yml"] = cm["data"]["alerts.yml"].replace(
        "severity: critical", "severity: x", 1
    )
    assert ck.check_prometheus_config(objs)


def test_podmonitor_check_fails_on_a_wrong_port_job_or_release() -> None:
    objs = rendered("monitoring")
    del find(objs, "PodMonitor", "pcp-pd-decode")[0]["metadata"]["labels"]["release"]
    assert ck.check_podmonitors(objs) == [
        "PodMonitor pcp-pd-decode lacks release: kube-prometheus-stack"
    ]
    objs = rendered("monitoring")
    find(objs, "PodMonitor", "pcp-pd-proxy")[0]["spec"]["podMetricsEndpoints"][0]["port"] = "http2"
    assert ck.check_podmonitors(objs)
    objs = rendered("monitoring")
    relabel = find(objs, "PodMonitor", "pcp-pd-decode")[0]["spec"]["podMetricsEndpoints"][0]
    relabel["relabelings"][0]["replacement"] = "vllm-decode"
    assert ck.check_podmonitors(objs)


def test_dashboard_check_fails_on_drift(tmp_path: Path) -> None:
    for path in DASHBOARDS.glob("*.json"):
        (tmp_path / path.name).write_text(path.read_text().replace("P/D", "PD"))
    (tmp_path / "extra.json").write_text("{}")
    assert len(ck.check_dashboards(rendered("monitoring"), tmp_path)) >= 2
