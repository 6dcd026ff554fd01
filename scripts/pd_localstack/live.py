"""Read the live stack: /metrics pages and Prometheus's HTTP API, turned into report checks."""

from __future__ import annotations

import importlib
import logging
import sys
import time
from pathlib import Path

from pd_localstack import report
from pd_localstack.http_client import HttpError, get_json, get_text
from pd_localstack.metrics import Sample, parse_metrics, total
from pd_localstack.prometheus_config import SCRAPE_JOBS
from pd_localstack.report import Check

log = logging.getLogger("pd_localstack")


def scrape(url: str) -> list[Sample]:
    """Parsed /metrics of one server; an unreadable or unparsable page raises HttpError."""
    metrics_url = f"{url}/metrics"
    text = get_text(metrics_url)
    try:
        return parse_metrics(text)
    except ValueError as exc:
        raise HttpError(metrics_url, 200, f"not Prometheus text ({exc}): {text}") from None


def dedup_metric_names(repo: Path) -> tuple[str, ...]:
    """The connector's own tuple of dedup counter names (imports without vLLM)."""
    connector_dir = str(repo / "connector")
    if connector_dir not in sys.path:
        sys.path.insert(0, connector_dir)
    try:
        module = importlib.import_module("pcp_nixl_connector.metric_names")
    except ImportError:
        return ()
    return tuple(module.DEDUP_METRIC_NAMES)


def prometheus_query(prometheus_url: str, query: str) -> dict:
    return get_json(f"{prometheus_url}/api/v1/query", {"query": query})


def wait_for_scrape(prometheus_url: str, decode_url: str, timeout_s: float = 60.0) -> None:
    """Wait until Prometheus's view of decode's external-KV counter matches /metrics.

    The report must read Prometheus after it scraped the traffic just sent, not a stale sample.
    Returns at once when decode's /metrics is unreadable: its own check reports that.
    """
    try:
        decode = scrape(decode_url)
    except HttpError as exc:
        log.warning("not waiting for Prometheus: decode's /metrics is unreadable: %s", exc)
        return
    want = total(decode, report.PROMPT_TOKENS_BY_SOURCE, source=report.EXTERNAL_KV)
    if want is None:
        log.warning(
            "decode exports no %s: not waiting for Prometheus", report.PROMPT_TOKENS_BY_SOURCE
        )
        return
    query = f'sum({report.PROMPT_TOKENS_BY_SOURCE}{{source="{report.EXTERNAL_KV}"}})'
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            seen = report.query_value(prometheus_query(prometheus_url, query))
        except HttpError:
            seen = None
        if seen is not None and seen >= want:
            return
        time.sleep(1.0)
    log.warning("Prometheus had not caught up with decode's counters after %.0fs", timeout_s)


def live_checks(urls: dict[str, str], repo: Path) -> list[Check]:
    """Every report check, read from the running proxy, decode and Prometheus."""
    checks: list[Check] = []
    try:
        checks.append(report.requests_served(scrape(urls["proxy"])))
    except HttpError as exc:
        checks.append(Check("proxy served requests", False, str(exc)))
    try:
        checks.extend(report.kv_crossed_nixl(scrape(urls["decode"])))
    except HttpError as exc:
        checks.append(Check("decode metrics readable", False, str(exc)))
    prom = urls["prometheus"]
    wait_for_scrape(prom, urls["decode"])
    try:
        checks.append(report.targets_up(get_json(f"{prom}/api/v1/targets"), SCRAPE_JOBS))
    except HttpError as exc:
        checks.append(Check("every Prometheus target up", False, str(exc)))
    results = {}
    for name in dedup_metric_names(repo):
        try:
            results[name] = prometheus_query(prom, name)
        except HttpError as exc:
            results[name] = {"status": "error", "error": str(exc)}
    checks.extend(report.dedup_counters(results))
    return checks
