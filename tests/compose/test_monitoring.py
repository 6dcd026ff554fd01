"""Prometheus config, alert rules and the Grafana provisioning against the compose services and
the metric names that really exist (vLLM source, connector and proxy name tuples)."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess

import pytest
import yaml

from tests.compose import checks as cc
from tests.compose import compose_cli as cli
from tests.compose import promql_names as mn
from tests.support.paths import COMPOSE_DIR

PROM_DIR = COMPOSE_DIR / "prometheus"
GRAFANA_DIR = COMPOSE_DIR / "grafana"
DASHBOARD = GRAFANA_DIR / "dashboards" / "pcp-pd-kit.json"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed")


@pytest.fixture(scope="module")
def compose() -> dict:
    """The GPU deployment with Grafana, as `docker compose up` sees it with .env.example."""
    return cli.config()


@pytest.fixture(scope="module")
def compose_cpu() -> dict:
    return cli.config(profiles=["cpu", "grafana"])


@pytest.fixture(scope="module")
def prom() -> dict:
    return yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())


@pytest.fixture(scope="module")
def known_metrics() -> set[str]:
    return mn.vllm_metric_bases() | mn.kit_metric_bases() | {"up"}


@pytest.fixture(scope="module")
def alert_rules() -> list[dict]:
    groups = yaml.safe_load((PROM_DIR / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


@pytest.fixture(scope="module")
def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


@pytest.mark.parametrize("model", ["compose", "compose_cpu"])
def test_prometheus_targets_are_compose_services(request, model, prom) -> None:
    assert cc.check_prometheus_targets(request.getfixturevalue(model), prom) == []


def test_proxy_is_scraped_on_its_metrics_port(compose, prom) -> None:
    proxy_env = cc.environment(compose["services"]["proxy"])
    job = next(j for j in prom["scrape_configs"] if j["job_name"] == "proxy")
    assert job["static_configs"][0]["targets"] == [f"proxy:{proxy_env['PD_PROXY_METRICS_PORT']}"]


@pytest.mark.parametrize(
    ("target", "job"),
    [("prefill:9999", 0), ("proxy:8000", 2), ("vllm-prefill:8100", 0)],
    ids=["wrong-port", "proxy-api-port", "no-such-service"],
)
def test_target_check_catches_a_wrong_target(compose, prom, target, job) -> None:
    broken = copy.deepcopy(prom)
    scrape = broken["scrape_configs"][job]
    host, _, port = target.rpartition(":")
    if "dns_sd_configs" in scrape:
        scrape["dns_sd_configs"][0].update(names=[host], port=int(port))
    else:
        scrape["static_configs"][0]["targets"] = [target]
    problems = cc.check_prometheus_targets(compose, broken)
    assert any(target in p for p in problems), problems
    assert any("not scraped" in p for p in problems), problems


def test_every_server_replica_is_scraped_by_dns(prom) -> None:
    """xPyD: the vLLM servers are found by A-record lookups of their service names (one record
    per replica), never as one fixed target, which would reach one replica only."""
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    for role in ("prefill", "decode"):
        assert "static_configs" not in jobs[role], role
        [sd] = jobs[role]["dns_sd_configs"]
        assert (sd["names"], sd["type"]) == ([role], "A"), role


def test_compose_mounts_the_monitoring_config(compose, prom) -> None:
    assert cc.check_monitoring_mounts(compose, prom["rule_files"]) == []
    assert cc.check_monitoring_mounts(compose, ["no-such-rules.yml"]) == [
        f"prometheus: no-such-rules.yml not in {PROM_DIR}"
    ]
    broken = copy.deepcopy(compose)
    prometheus = broken["services"]["prometheus"]
    prometheus["command"] = ["--config.file=/etc/prom/prometheus.yml"]
    grafana_binds = cc.bind_mounts(broken["services"]["grafana"])
    grafana_binds[0]["source"] = str(GRAFANA_DIR / "missing")
    grafana_binds[1].pop("read_only")
    problems = cc.check_monitoring_mounts(broken, prom["rule_files"])
    assert any("nothing mounted at '/etc/prom'" in p for p in problems), problems
    assert any(p.startswith("grafana: bind source") for p in problems), problems
    assert any(p.startswith("grafana:") and "not read-only" in p for p in problems), problems


def test_alerts_cover_dedup_nixl_failures_and_targets(alert_rules) -> None:
    by_name = {r["alert"]: r["expr"] for r in alert_rules}
    assert "vllm:nixl_pcp_finished_sending_suppressed_total" in by_name["PcpDedupInvariantBroken"]
    assert "vllm:nixl_pcp_canonical_completions_total" in by_name["PcpDedupInvariantBroken"]
    # Any prefill target without the connector's gauge (exported from start-up, PCP1 too): no
    # scrape label has to be kept in step with PREFILLER_PCP_SIZE.
    missing = by_name["PcpConnectorMissing"]
    assert 'up{job="prefill"}' in missing
    assert "vllm:nixl_pcp_expected_suppressed_per_completion" in mn.metrics_in_query(missing)
    assert "pcp_size" not in missing
    assert "vllm:nixl_num_failed_transfers_total" in by_name["NixlTransferFailures"]
    assert "up{" in by_name["PdTargetDown"]
    for job in ("prefill", "decode", "proxy"):
        assert job in by_name["PdTargetDown"]


def test_alerts_cover_the_signs_of_wrong_or_lost_answers(alert_rules) -> None:
    """Expired leases, reads after expiry, failed transfers and notifications, a decode whose KV
    pulls hang, and the proxy's canary."""
    from pd_proxy.api.canary import METRIC_NAMES as CANARY_METRIC_NAMES

    reads = {r["alert"]: mn.metrics_in_query(r["expr"]) for r in alert_rules}
    assert reads["NixlKvLeaseExpired"] == {"vllm:nixl_num_kv_expired_reqs_total"}
    assert reads["NixlNotificationsAfterExpiry"] == {
        "vllm:nixl_num_notifications_after_expiry_total"
    }
    assert reads["NixlTransferFailures"] == {"vllm:nixl_num_failed_transfers_total"}
    assert reads["NixlNotificationFailures"] == {"vllm:nixl_num_failed_notifications_total"}
    assert reads["DecodeKvPullStalled"] == {
        "vllm:num_requests_kv_fetch_by_stage",
        "vllm:nixl_xfer_time_seconds_count",
    }
    assert reads["PdCanaryMismatch"] == {"pd_proxy_canary_mismatches_total"}
    assert "pd_proxy_canary_mismatches_total" in CANARY_METRIC_NAMES


def test_stall_alert_counts_the_pending_stages_vllm_exports(alert_rules) -> None:
    """waiting_to_start and in_progress are vLLM 0.32's pending stages (v1/metrics/stats.py);
    completed_waiting (KV arrived, waiting for a step) must not count as a hang."""
    import importlib.util
    import re
    from pathlib import Path

    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    stats = Path(next(iter(spec.submodule_search_locations))) / "v1" / "metrics" / "stats.py"
    stages = dict(re.findall(r'^(KV_FETCH_\w+) = "(\w+)"', stats.read_text(), re.M))
    assert stages["KV_FETCH_WAITING_TO_START"] == "waiting_to_start"
    assert stages["KV_FETCH_IN_PROGRESS"] == "in_progress"
    assert stages["KV_FETCH_COMPLETED_WAITING"] == "completed_waiting"
    expr = next(r["expr"] for r in alert_rules if r["alert"] == "DecodeKvPullStalled")
    assert 'stage=~"waiting_to_start|in_progress"' in expr
    assert "unless on (job, instance, engine)" in expr  # no transfer series at all still fires


def test_every_alert_says_what_to_do(alert_rules) -> None:
    actions = ("check", "set ", "raise", "restart", "run ", "treat", "recreate", "drain")
    for rule in alert_rules:
        annotations = rule["annotations"]
        assert annotations["summary"], rule["alert"]
        text = annotations["description"].lower()
        assert any(word in text for word in actions), rule["alert"]


def test_dedup_alert_reads_the_connector_gauge_not_the_pcp_size_label(alert_rules) -> None:
    """p comes from the connector (0 in world_size mode, PCP1, consumers), not a scrape label
    that the cpu profile's PCP1 prefill shares with the PCP2 one."""
    from pcp_nixl_connector.metric_names import (
        DEDUP_METRIC_NAMES,
        EXPECTED_SUPPRESSED_PER_COMPLETION,
    )

    expr = next(r["expr"] for r in alert_rules if r["alert"] == "PcpDedupInvariantBroken")
    assert EXPECTED_SUPPRESSED_PER_COMPLETION in DEDUP_METRIC_NAMES
    assert EXPECTED_SUPPRESSED_PER_COMPLETION in mn.metrics_in_query(expr)
    assert "pcp_size" not in expr


def test_alert_queries_name_existing_metrics(alert_rules, known_metrics) -> None:
    unknown = {
        (rule["alert"], name)
        for rule in alert_rules
        for name in mn.metrics_in_query(rule["expr"])
        if mn.base_name(name) not in known_metrics
    }
    assert not unknown, unknown


def test_grafana_queries_name_existing_metrics(dashboard_exprs, known_metrics) -> None:
    assert dashboard_exprs
    unknown = {
        name
        for expr in dashboard_exprs
        for name in mn.metrics_in_query(expr)
        if mn.base_name(name) not in known_metrics
    }
    assert not unknown, unknown


def test_metric_name_check_can_fail(known_metrics) -> None:
    names = mn.metrics_in_query("rate(vllm:nixl_xfer_time_secnds_bucket[5m])")
    assert names == {"vllm:nixl_xfer_time_secnds_bucket"}
    assert mn.base_name(names.pop()) not in known_metrics


def test_dashboard_covers_the_promised_panels(dashboard_exprs) -> None:
    text = "\n".join(dashboard_exprs)
    for metric in (
        "pd_proxy_request_duration_seconds_bucket",
        "pd_proxy_prefill_duration_seconds_bucket",
        "pd_proxy_decode_ttfb_seconds_bucket",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:nixl_xfer_time_seconds_bucket",
        "vllm:nixl_bytes_transferred_sum",
        "vllm:nixl_num_failed_transfers_total",
        "vllm:prompt_tokens_by_source_total",
        "vllm:nixl_pcp_handshake_publications_skipped_total",
        "vllm:nixl_pcp_finished_sending_suppressed_total",
        "vllm:nixl_pcp_canonical_completions_total",
        "pd_proxy_time_to_first_byte_seconds_bucket",
        # admission: outcomes by reason, queue depth and wait per flow, room per replica
        "pd_proxy_admission_total",
        "pd_proxy_queue_depth",
        "pd_proxy_queue_wait_seconds_bucket",
        "pd_proxy_admitted_in_flight",
        "pd_proxy_admission_limit",
    ):
        assert metric in text, metric


def test_dashboard_has_the_handover_row() -> None:
    """Per-phase p50/p95 of the connector's handover histogram, the prefill's hold against its
    lease, and the proxy's prefill leg / decode TTFB / client TTFB."""
    from pcp_nixl_connector.handover import PHASES
    from pcp_nixl_connector.metric_names import HANDOVER_SECONDS, KV_LEASE_SECONDS

    panels = json.loads(DASHBOARD.read_text())["panels"]
    row = next(i for i, p in enumerate(panels) if p["type"] == "row" and "handover" in p["title"])
    end = next((i for i in range(row + 1, len(panels)) if panels[i]["type"] == "row"), len(panels))
    exprs = [t["expr"] for p in panels[row + 1 : end] for t in p["targets"]]
    text = "\n".join(exprs)
    by_phase = [e for e in exprs if "sum by (le, phase)" in e]
    for quantile in ("0.5", "0.95"):
        assert any(e.startswith(f"histogram_quantile({quantile},") for e in by_phase), quantile
    assert all(f"{HANDOVER_SECONDS}_bucket" in e and "$__rate_interval" in e for e in by_phase)
    assert "prefill_kv_hold" in PHASES and 'phase="prefill_kv_hold"' in text
    assert KV_LEASE_SECONDS in mn.metrics_in_query(text)
    # the client's time to first byte by path (pd, local: decode alone), the legs' as they are
    for proxy, by in (
        ("time_to_first_byte", "le, path"),
        ("prefill_duration", "le"),
        ("decode_ttfb", "le"),
    ):
        for quantile in ("0.5", "0.95"):
            bucket = f"pd_proxy_{proxy}_seconds_bucket"
            assert f"histogram_quantile({quantile}, sum by ({by}) (rate({bucket}" in text
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))


def test_grafana_datasource_and_dashboard_provisioning(compose) -> None:
    ds = yaml.safe_load((GRAFANA_DIR / "provisioning/datasources/prometheus.yml").read_text())
    source = ds["datasources"][0]
    host_port = source["url"].removeprefix("http://")
    host, port = host_port.split(":")
    assert int(port) in cc.service_ports(compose)[host]
    dash = json.loads(DASHBOARD.read_text())
    uids = {
        t["datasource"]["uid"]
        for p in dash["panels"]
        for t in p.get("targets", [])
        if "datasource" in t
    }
    assert uids == {source["uid"]}
    providers = yaml.safe_load((GRAFANA_DIR / "provisioning/dashboards/pcp-pd-kit.yml").read_text())
    path = providers["providers"][0]["options"]["path"]
    mounts = cc.bind_mounts(compose["services"]["grafana"])
    assert any(m["target"] == path and m.get("read_only") for m in mounts), mounts


@needs_promtool
@pytest.mark.parametrize(
    "argv",
    [
        ["check", "config", "prometheus.yml"],
        ["check", "rules", "alerts.yml"],
        ["test", "rules", "alerts.test.yml"],
    ],
    ids=["check-config", "check-rules", "test-rules"],
)
def test_promtool(argv: list[str]) -> None:
    res = subprocess.run(
        [PROMTOOL, *argv], cwd=PROM_DIR, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stdout + res.stderr
