"""The demo's report: checks over what the live system returned, kept free of I/O.

Inputs are /metrics pages (parsed here into samples, summed by name and labels) and Prometheus
HTTP API JSON; each check says what it saw so a failure message names the check and the number
behind it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pcp_nixl_connector.metric_names import CANONICAL_COMPLETIONS as CANONICAL_COMPLETIONS_BASE
from pd_proxy.metrics import REQUESTS_TOTAL

EXTERNAL_KV = "external_kv_transfer"
PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
NIXL_XFER_COUNT = "vllm:nixl_xfer_time_seconds_count"
NIXL_FAILED = "vllm:nixl_num_failed_transfers_total"
# The connector's own name (one spelling); prometheus_client adds _total to a counter.
CANONICAL_COMPLETIONS = f"{CANONICAL_COMPLETIONS_BASE}_total"


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse_metrics(text: str) -> list[Sample]:
    """Every sample of a /metrics page (counter samples keep their _total suffix)."""
    return [
        Sample(s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def select(samples: Iterable[Sample], name: str, **labels: str) -> list[Sample]:
    """Samples with this exact name whose labels include the given ones."""
    return [
        s
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]


def total(samples: Iterable[Sample], name: str, **labels: str) -> float | None:
    """Sum over matching samples; None when the metric is absent (distinct from 0)."""
    found = select(samples, name, **labels)
    return sum(s.value for s in found) if found else None


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def _fmt(value: float | None) -> str:
    return "absent" if value is None else f"{value:g}"


def _is_success(status: str) -> bool:
    return status.startswith("2") or status.lower() in ("ok", "success")


def requests_served(proxy: Sequence[Sample]) -> Check:
    """The proxy answered at least one request with a 2xx."""
    ok_count = sum(
        s.value
        for s in proxy
        if s.name == REQUESTS_TOTAL and _is_success(s.labels.get("status", ""))
    )
    all_count = total(proxy, REQUESTS_TOTAL)
    return Check(
        "proxy served requests",
        ok_count > 0,
        f"{REQUESTS_TOTAL}: {ok_count:g} succeeded of {_fmt(all_count)}",
    )


def kv_crossed_nixl(decode: Sequence[Sample]) -> list[Check]:
    """Decode's own counters: prompt tokens arrived by KV transfer, transfers ran, none failed."""
    external = total(decode, PROMPT_TOKENS_BY_SOURCE, source=EXTERNAL_KV)
    xfers = total(decode, NIXL_XFER_COUNT)
    failed = total(decode, NIXL_FAILED)
    return [
        Check(
            "decode received prompt KV over NIXL",
            (external or 0) > 0,
            f'{PROMPT_TOKENS_BY_SOURCE}{{source="{EXTERNAL_KV}"}} = {_fmt(external)}',
        ),
        Check("NIXL transfers happened", (xfers or 0) > 0, f"{NIXL_XFER_COUNT} = {_fmt(xfers)}"),
        Check("no failed NIXL transfers", failed == 0, f"{NIXL_FAILED} = {_fmt(failed)}"),
    ]


def targets_up(targets_json: Mapping[str, Any], expected_jobs: Iterable[str]) -> Check:
    """Every active target of Prometheus is up, and every expected job has one."""
    active = targets_json.get("data", {}).get("activeTargets", [])
    health = {t.get("labels", {}).get("job", "?"): t.get("health") for t in active}
    missing = [job for job in expected_jobs if job not in health]
    down = [f"{job}={state}" for job, state in health.items() if state != "up"]
    ok = bool(active) and not missing and not down
    detail = ", ".join(f"{job}={state}" for job, state in sorted(health.items())) or "no targets"
    if missing:
        detail += f"; missing jobs: {', '.join(missing)}"
    return Check("every Prometheus target up", ok, detail)


def query_value(query_json: Mapping[str, Any]) -> float | None:
    """Sum of an instant vector from /api/v1/query; None when the series does not exist."""
    if query_json.get("status") != "success":
        return None
    result = query_json.get("data", {}).get("result", [])
    if not result:
        return None
    return sum(float(r["value"][1]) for r in result)


def dedup_counters(query_results: Mapping[str, Mapping[str, Any]]) -> list[Check]:
    """The connector's dedup metrics exist in Prometheus; canonical completions counted > 0.

    On this PCP1 prefill the two suppression counters and the expected-suppression gauge stay 0
    (nothing to suppress) but must be exported; every finished transfer is a canonical completion.
    """
    checks = []
    for name, result in query_results.items():
        value = query_value(result)
        if name == CANONICAL_COMPLETIONS:
            checks.append(Check(f"{name} > 0", (value or 0) > 0, f"{name} = {_fmt(value)}"))
        else:
            checks.append(Check(f"{name} present", value is not None, f"{name} = {_fmt(value)}"))
    if not checks:
        checks.append(Check("dedup counters known", False, "no dedup metric names to query"))
    return checks


def format_report(checks: Sequence[Check]) -> str:
    width = max(len(c.name) for c in checks) if checks else 0
    lines = [f"  [{'PASS' if c.ok else 'FAIL'}] {c.name:<{width}}  {c.detail}" for c in checks]
    return "\n".join(lines)


def failed(checks: Sequence[Check]) -> list[Check]:
    return [c for c in checks if not c.ok]
