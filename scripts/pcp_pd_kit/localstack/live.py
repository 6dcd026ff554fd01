"""Read the live stack: /metrics pages and Prometheus's HTTP API, turned into report checks."""

from __future__ import annotations

import http.client
import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from pcp_nixl_connector.metric_names import DEDUP_METRIC_NAMES
from pcp_pd_kit.localstack import report
from pcp_pd_kit.localstack.prometheus_config import SCRAPE_JOBS
from pcp_pd_kit.localstack.report import Check, Sample, parse_metrics, total

log = logging.getLogger("pcp_pd_kit.localstack")


# Plain urllib: the launcher needs no event loop and no extra package to read the stack.
class HttpError(RuntimeError):
    """A request that failed; carries the status (None when nothing answered) and the body."""

    def __init__(self, url: str, status: int | None, body: str) -> None:
        super().__init__(f"{url}: {status if status is not None else 'no answer'}: {body[:500]}")
        self.url = url
        self.status = status
        self.body = body


def _fetch(request: urllib.request.Request | str, timeout_s: float) -> tuple[int, str]:
    """Status and body text; every way of failing becomes an HttpError."""
    url = request if isinstance(request, str) else request.full_url
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        raise HttpError(url, exc.code, exc.read().decode(errors="replace")) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        raise HttpError(url, None, str(exc)) from None


def get_text(url: str, timeout_s: float = 10.0) -> str:
    return _fetch(url, timeout_s)[1]


def _decode_json(url: str, status: int | None, text: str) -> Any:
    """json.loads, with a body that is not JSON raised as HttpError like any other bad answer."""
    try:
        return json.loads(text)
    except ValueError as exc:
        raise HttpError(url, status, f"not JSON ({exc}): {text}") from None


def get_json(url: str, params: dict[str, str] | None = None, timeout_s: float = 10.0) -> Any:
    if params:
        url = f"{url}?{urllib.parse.urlencode(params)}"
    return _decode_json(url, *_fetch(url, timeout_s))


def post_json(url: str, payload: dict[str, Any], timeout_s: float = 300.0) -> Any:
    request = urllib.request.Request(
        url,
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    return _decode_json(url, *_fetch(request, timeout_s))


def scrape(url: str) -> list[Sample]:
    """Parsed /metrics of one server; an unreadable or unparsable page raises HttpError."""
    metrics_url = f"{url}/metrics"
    text = get_text(metrics_url)
    try:
        return parse_metrics(text)
    except ValueError as exc:
        raise HttpError(metrics_url, 200, f"not Prometheus text ({exc}): {text}") from None


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


def live_checks(urls: dict[str, str]) -> list[Check]:
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
    for name in DEDUP_METRIC_NAMES:
        try:
            results[name] = prometheus_query(prom, name)
        except HttpError as exc:
            results[name] = {"status": "error", "error": str(exc)}
    checks.extend(report.dedup_counters(results))
    return checks
