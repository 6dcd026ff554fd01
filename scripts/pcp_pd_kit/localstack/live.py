"""Read the live stack: /metrics pages and Prometheus's HTTP API, turned into report checks."""

from __future__ import annotations

import http.client
import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime
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


def get_text(url: str, timeout_s: float = 10.0, headers: dict[str, str] | None = None) -> str:
    """The body of a GET; ``headers``: e.g. the proxy's client key (keys.auth_headers)."""
    return _fetch(urllib.request.Request(url, headers=headers or {}), timeout_s)[1]


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


def post_json(
    url: str,
    payload: dict[str, Any],
    timeout_s: float = 300.0,
    headers: dict[str, str] | None = None,
) -> Any:
    request = urllib.request.Request(
        url,
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
        method="POST",
    )
    return _decode_json(url, *_fetch(request, timeout_s))


def scrape(url: str, headers: dict[str, str] | None = None) -> list[Sample]:
    """Parsed /metrics of one server; an unreadable or unparsable page raises HttpError."""
    metrics_url = f"{url}/metrics"
    text = get_text(metrics_url, headers=headers)
    try:
        return parse_metrics(text)
    except ValueError as exc:
        raise HttpError(metrics_url, 200, f"not Prometheus text ({exc}): {text}") from None


def prometheus_query(prometheus_url: str, query: str) -> dict:
    return get_json(f"{prometheus_url}/api/v1/query", {"query": query})


PREFILL_JOB = "prefill"
KV_USAGE = "vllm:kv_cache_usage_perc"
RUNNING = "vllm:num_requests_running"


def settle_prefill(prefill_url: str, timeout_s: float) -> float | None:
    """Wait until prefill holds no KV and every request it held KV for has been released (its
    canonical completion counted); returns the wall-clock time it was seen settled, None after
    timeout_s.

    A P/D request's prefill blocks are freed only after decode pulled them (or the lease ran
    out), so counters read right after the last response can still be one request short.
    """
    deadline = time.monotonic() + timeout_s
    seen = "nothing read"
    while time.monotonic() < deadline:
        try:
            samples = scrape(prefill_url)
        except HttpError as exc:
            seen = str(exc)
        else:
            usage, running = total(samples, KV_USAGE), total(samples, RUNNING)
            held = total(samples, report.HELD_REQUESTS_TOTAL)
            canonical = total(samples, report.CANONICAL_COMPLETIONS)
            seen = f"usage={usage} running={running} held={held} canonical={canonical}"
            if usage == 0 and running == 0 and canonical is not None and canonical >= (held or 0):
                return time.time()
        time.sleep(0.5)
    log.warning("prefill had not settled after %.0fs (%s)", timeout_s, seen)
    return None


def _scrape_time(rfc3339: str) -> float:
    """Prometheus's lastScrape (nanosecond RFC 3339, 'Z') as epoch seconds."""
    stamp = rfc3339.replace("Z", "+00:00")
    head, dot, tail = stamp.partition(".")
    if dot:  # fromisoformat takes at most microseconds
        digits = tail[: len(tail) - len(tail.lstrip("0123456789"))]
        zone = tail[len(digits) :]
        stamp = f"{head}.{digits[:6]}{zone}"
    return datetime.fromisoformat(stamp).timestamp()


def wait_for_scrape_after(
    prometheus_url: str, job: str, since_epoch: float, timeout_s: float = 60.0
) -> bool:
    """Wait until Prometheus scraped ``job`` after ``since_epoch``, so a query reads the values
    the stack had then, not an older sample. False (logged) after timeout_s."""
    deadline = time.monotonic() + timeout_s
    last = "no scrape seen"
    while time.monotonic() < deadline:
        try:
            targets = get_json(f"{prometheus_url}/api/v1/targets")["data"]["activeTargets"]
            stamps = [
                _scrape_time(t["lastScrape"])
                for t in targets
                if t.get("labels", {}).get("job") == job and t.get("health") == "up"
            ]
        except (HttpError, KeyError, TypeError, ValueError) as exc:
            last = f"targets unreadable: {exc}"
        else:
            if stamps and min(stamps) > since_epoch:
                return True
            last = f"last scrape of {job} at {max(stamps) if stamps else 'never'}"
        time.sleep(0.5)
    log.warning(
        "Prometheus did not scrape %s after %.3f within %.0fs (%s)",
        job,
        since_epoch,
        timeout_s,
        last,
    )
    return False


def prefill_view(prometheus_url: str) -> report.PrefillView:
    """The prefill job's dedup counters, held requests and KV usage, from Prometheus."""

    def value(name: str) -> float | None:
        try:
            return report.query_value(
                prometheus_query(prometheus_url, f'sum({name}{{job="{PREFILL_JOB}"}})')
            )
        except HttpError:
            return None

    skipped, suppressed, canonical, expected = (value(name) for name in DEDUP_METRIC_NAMES)
    return report.PrefillView(
        skipped=skipped,
        suppressed=suppressed,
        canonical=canonical,
        expected_per_completion=expected,
        held=value(report.HELD_REQUESTS_TOTAL),
        kv_usage=value(KV_USAGE),
    )


def live_checks(
    urls: dict[str, str],
    pcp: int,
    settle_timeout_s: float = 60.0,
    proxy_headers: dict[str, str] | None = None,
) -> list[Check]:
    """Every report check, read from the running proxy (with ``proxy_headers``: its client key),
    decode and Prometheus.

    The dedup invariants are read back from Prometheus after prefill settled and Prometheus
    scraped it once more, so they compare the finished traffic, not a sample taken mid-flight.
    """
    checks: list[Check] = []
    try:
        checks.append(report.requests_served(scrape(urls["proxy"], proxy_headers)))
    except HttpError as exc:
        checks.append(Check("proxy served requests", False, str(exc)))
    try:
        checks.extend(report.kv_crossed_nixl(scrape(urls["decode"])))
    except HttpError as exc:
        checks.append(Check("decode metrics readable", False, str(exc)))
    prom = urls["prometheus"]
    settled_at = settle_prefill(urls["prefill"], settle_timeout_s)
    scraped = settled_at is not None and wait_for_scrape_after(prom, PREFILL_JOB, settled_at)
    try:
        checks.append(report.targets_up(get_json(f"{prom}/api/v1/targets"), SCRAPE_JOBS))
    except HttpError as exc:
        checks.append(Check("every Prometheus target up", False, str(exc)))
    if not scraped:
        checks.append(
            Check(
                "Prometheus scraped the settled prefill",
                False,
                "prefill never settled (KV still held)"
                if settled_at is None
                else "no prefill scrape after it settled",
            )
        )
    checks.extend(report.dedup_invariants(prefill_view(prom), pcp))
    return checks
