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
from pcp_nixl_connector.metric_names import HELD_REQUESTS
from pd_proxy.metrics import REQUESTS_TOTAL

EXTERNAL_KV = "external_kv_transfer"
PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
NIXL_XFER_COUNT = "vllm:nixl_xfer_time_seconds_count"
NIXL_FAILED = "vllm:nixl_num_failed_transfers_total"
# The connector's own name (one spelling); prometheus_client adds _total to a counter.
CANONICAL_COMPLETIONS = f"{CANONICAL_COMPLETIONS_BASE}_total"
HELD_REQUESTS_TOTAL = f"{HELD_REQUESTS}_total"


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
    # How they went: through a prefill, or to decode alone (--local-prefill-max-tokens, shapes).
    paths = {
        path: sum(
            s.value
            for s in proxy
            if s.name == REQUESTS_TOTAL
            and s.labels.get("path") == path
            and _is_success(s.labels.get("status", ""))
        )
        for path in ("pd", "local")
    }
    by_path = f" (P/D {paths['pd']:g}, decode alone {paths['local']:g})"
    return Check(
        "proxy served requests",
        ok_count > 0,
        f"{REQUESTS_TOTAL}: {ok_count:g} succeeded of {_fmt(all_count)}{by_path}",
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


@dataclass(frozen=True)
class PrefillView:
    """What Prometheus holds for the prefill job once its traffic has settled (None = absent)."""

    skipped: float | None
    suppressed: float | None
    canonical: float | None
    expected_per_completion: float | None
    held: float | None  # requests finished with their KV held for decode (P/D prefill legs)
    kv_usage: float | None


def dedup_invariants(view: PrefillView, pcp: int, tp_pp: int = 1) -> list[Check]:
    """The replicated-PCP invariants of a settled kv_producer with the kit's connector.

    Every request prefill held KV for is one canonical completion per TP x PP position; every
    non-canonical rank's duplicate report is suppressed; ranks > 0 skip the handshake publication
    once per engine start; and nothing is left in the KV cache (the stock connector leaks here).
    """
    canonical, held = view.canonical, view.held
    want_expected = float(pcp - 1)
    checks = [
        Check(
            "canonical completions = P/D requests held",
            canonical is not None and (canonical or 0) > 0 and canonical == (held or 0) * tp_pp,
            f"{CANONICAL_COMPLETIONS} = {_fmt(canonical)}, {HELD_REQUESTS_TOTAL} = {_fmt(held)}, "
            f"TP x PP = {tp_pp}",
        ),
        Check(
            f"suppressed duplicates = completions x (PCP-1), PCP={pcp}",
            view.expected_per_completion == want_expected
            and view.suppressed is not None
            and view.suppressed == (canonical or 0) * want_expected,
            f"suppressed = {_fmt(view.suppressed)}, expected per completion (gauge) = "
            f"{_fmt(view.expected_per_completion)}, want {want_expected:g}",
        ),
        Check(
            "handshake publication skipped on PCP ranks > 0",
            view.skipped == (pcp - 1) * tp_pp,
            f"skipped = {_fmt(view.skipped)}, want {(pcp - 1) * tp_pp} per engine start",
        ),
        Check(
            "prefill KV cache back to 0",
            view.kv_usage == 0,
            f"vllm:kv_cache_usage_perc = {_fmt(view.kv_usage)}",
        ),
    ]
    return checks


def format_report(checks: Sequence[Check]) -> str:
    width = max(len(c.name) for c in checks) if checks else 0
    lines = [f"  [{'PASS' if c.ok else 'FAIL'}] {c.name:<{width}}  {c.detail}" for c in checks]
    return "\n".join(lines)


def failed(checks: Sequence[Check]) -> list[Check]:
    return [c for c in checks if not c.ok]
