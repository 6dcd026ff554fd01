"""The side-by-side table (single vs P/D per concurrency) and the P/D overhead breakdown.

Inputs are `vllm bench serve` result JSONs (its own keys: median_ttft_ms, p99_ttft_ms, ...) and
histogram deltas; outputs are plain text and JSON-ready dicts. No I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pcp_pd_kit.bench.histograms import Histogram

Result = Mapping[str, Any]
# (row label, key in vllm bench serve's result JSON, "lower" or "higher" is better)
METRICS: tuple[tuple[str, str, str], ...] = (
    ("TTFT median (ms)", "median_ttft_ms", "lower"),
    ("TTFT p99 (ms)", "p99_ttft_ms", "lower"),
    ("TPOT median (ms)", "median_tpot_ms", "lower"),
    ("ITL median (ms)", "median_itl_ms", "lower"),
    ("E2E latency median (ms)", "median_e2el_ms", "lower"),
    ("requests/s", "request_throughput", "higher"),
    ("output tokens/s", "output_throughput", "higher"),
)


def value(result: Result | None, key: str) -> float | None:
    """A finite number from a result, or None (missing run, missing key, NaN)."""
    if not result:
        return None
    raw = result.get(key)
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        return None
    return float(raw) if math.isfinite(raw) else None


def ratio(pd: float | None, single: float | None) -> float | None:
    """P/D divided by single; None when either is missing or single is 0."""
    if pd is None or single is None or single == 0:
        return None
    return pd / single


def fmt_num(number: float | None) -> str:
    if number is None:
        return "n/a"
    magnitude = abs(number)
    if magnitude >= 100:
        return f"{number:.0f}"
    if magnitude >= 10:
        return f"{number:.1f}"
    return f"{number:.2f}"


def fmt_ratio(number: float | None) -> str:
    return "n/a" if number is None else f"{number:.2f}x"


BURST_GAP_S = 0.0005  # SSE messages closer than this reached the client in the same read
BURSTY_ABOVE = 1.1  # tokens per delivery above which TTFT/TPOT/ITL are flagged
BURST_AFFECTED = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "median_itl_ms")


@dataclass(frozen=True)
class Delivery:
    """How a run's streams reached the client (from a --save-detailed result)."""

    tokens_per_delivery: float  # 1.0: every token arrived on its own, what TTFT/TPOT/ITL assume
    one_piece: int  # requests of more than one token that arrived all at once
    requests: int


def delivery(result: Result | None) -> Delivery | None:
    """Output tokens per separate arrival; None without per-request ITLs (no --save-detailed).

    An arrival is a streamed message more than BURST_GAP_S after the previous one (no decode
    step is that fast), so this catches both vLLM merging pending tokens into one message and
    messages piling up on the way (a server, the proxy or the client short of CPU). Either way
    TTFT then includes decode steps and TPOT/ITL understate; E2E and throughput stay right.
    """
    if not result:
        return None
    itls, outs = result.get("itls"), result.get("output_lens")
    if not isinstance(itls, list) or not isinstance(outs, list) or len(itls) != len(outs):
        return None
    tokens = arrivals = one_piece = requests = 0
    for itl, out in zip(itls, outs, strict=True):
        if not isinstance(out, int) or out <= 0 or not isinstance(itl, list):
            continue  # a failed request
        gaps = sum(1 for gap in itl if isinstance(gap, (int, float)) and gap >= BURST_GAP_S)
        tokens += out
        arrivals += 1 + gaps
        requests += 1
        one_piece += int(out > 1 and gaps == 0)
    if not arrivals:
        return None
    return Delivery(tokens / arrivals, one_piece, requests)


def delivery_warnings(
    results: Mapping[tuple[str, int], Result | None], levels: Sequence[int]
) -> list[str]:
    """One line per run whose streams reached the client in bursts."""
    lines = []
    for level in levels:
        for target, title in (("single", "single"), ("pd", "P/D")):
            d = delivery(results.get((target, level)))
            if d is not None and d.tokens_per_delivery > BURSTY_ABOVE:
                lines.append(
                    f"{title} c={level}: {d.tokens_per_delivery:.2f} tokens per delivery, "
                    f"{d.one_piece}/{d.requests} requests arrived in one piece"
                )
    return lines


def completed_text(result: Result | None, prompts: int) -> str:
    if not result:
        return "no result"
    done = value(result, "completed")
    failed = value(result, "failed") or 0
    text = f"{int(done or 0)}/{prompts}"
    return f"{text} ({int(failed)} failed)" if failed else text


def comparison_rows(
    results: Mapping[tuple[str, int], Result | None], levels: Sequence[int]
) -> list[dict[str, Any]]:
    """One dict per (level, metric): single, pd and their ratio, for the table and summary.json."""
    rows = []
    for level in levels:
        single, pd = results.get(("single", level)), results.get(("pd", level))
        for label, key, better in METRICS:
            s, p = value(single, key), value(pd, key)
            rows.append(
                {
                    "concurrency": level,
                    "metric": label,
                    "key": key,
                    "better": better,
                    "single": s,
                    "pd": p,
                    "pd_over_single": ratio(p, s),
                }
            )
    return rows


def format_table(
    results: Mapping[tuple[str, int], Result | None],
    levels: Sequence[int],
    prompts: Sequence[int],
    title: str = "",
) -> str:
    """The side-by-side table; a level or target that did not run shows n/a."""
    head = f"{'conc':>4}  {'metric':<24} {'single':>12} {'P/D':>12} {'P/D/single':>11}"
    lines = [title] if title else []
    lines += [head, "-" * len(head)]
    rows = comparison_rows(results, levels)
    for level, count in zip(levels, prompts, strict=True):
        done = [
            completed_text(results[(t, level)], count) if (t, level) in results else "not run"
            for t in ("single", "pd")
        ]
        lines.append(f"{level:>4}  {'completed':<24} {done[0]:>12} {done[1]:>12}")
        per = [delivery(results.get((t, level))) for t in ("single", "pd")]
        bursty = [d is not None and d.tokens_per_delivery > BURSTY_ABOVE for d in per]
        for row in (r for r in rows if r["concurrency"] == level):
            mark = ["*" if b and row["key"] in BURST_AFFECTED else "" for b in bursty]
            lines.append(
                f"{'':>4}  {row['metric']:<24} {fmt_num(row['single']) + mark[0]:>12} "
                f"{fmt_num(row['pd']) + mark[1]:>12} "
                f"{fmt_ratio(row['pd_over_single']) + max(mark):>11}"
            )
        cells = [fmt_num(d.tokens_per_delivery if d else None) for d in per]
        lines.append(f"{'':>4}  {'tokens per delivery':<24} {cells[0]:>12} {cells[1]:>12}")
    lines.append(
        "P/D/single: above 1.00x is slower for latencies (ms), faster for throughputs (/s)."
    )
    warnings = delivery_warnings(results, levels)
    if warnings:
        lines += [
            "WARNING: the streams marked * reached the client in bursts, so their TTFT includes",
            "decode steps and their TPOT/ITL understate (E2E and throughput are right); a server,",
            "the proxy or the client was short of CPU. Quote those three only from a quieter run:",
            *(f"  {w}" for w in warnings),
        ]
    return "\n".join(lines)


# --- the breakdown ---------------------------------------------------------------------------
@dataclass(frozen=True)
class BreakdownRow:
    """One line of the breakdown, in milliseconds; None where not measured.

    p50_ms is an exact median (client rows) or a difference of medians; histogram rows have
    p50_bucket_ms instead, the bucket holding the median, and p50_estimate_ms, the interpolation
    Prometheus's histogram_quantile would give (JSON only: with vLLM's coarse request buckets
    it says little).
    """

    label: str
    mean_ms: float | None
    p50_ms: float | None
    count: float | None
    source: str
    p50_bucket_ms: tuple[float, float] | None = None
    p50_estimate_ms: float | None = None


# (label, source, histogram) for the rows read from /metrics deltas of the P/D stack.
PD_HISTOGRAM_ROWS: tuple[tuple[str, str, str], ...] = (
    ("proxy: whole request", "proxy", "pd_proxy_request_duration_seconds"),
    ("proxy: prefill leg (sent -> JSON read)", "proxy", "pd_proxy_prefill_duration_seconds"),
    ("  prefill vLLM: request e2e", "prefill", "vllm:e2e_request_latency_seconds"),
    ("  prefill vLLM: queue", "prefill", "vllm:request_queue_time_seconds"),
    ("proxy: decode TTFB (incl. KV pull)", "proxy", "pd_proxy_decode_ttfb_seconds"),
    ("  decode vLLM: TTFT", "decode", "vllm:time_to_first_token_seconds"),
    ("  decode NIXL transfer (per xfer)", "decode", "vllm:nixl_xfer_time_seconds"),
)
SINGLE_HISTOGRAM_ROWS: tuple[tuple[str, str, str], ...] = (
    ("single vLLM: TTFT", "single", "vllm:time_to_first_token_seconds"),
)


def breakdown_metrics() -> dict[str, tuple[str, ...]]:
    """Source ('proxy', 'prefill', 'decode', 'single') -> the histograms to read from it."""
    wanted: dict[str, tuple[str, ...]] = {}
    for _label, source, name in PD_HISTOGRAM_ROWS + SINGLE_HISTOGRAM_ROWS:
        wanted[source] = wanted.get(source, ()) + (name,)
    return wanted


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def _hist_row(label: str, source: str, hist: Histogram | None) -> BreakdownRow:
    if hist is None:
        return BreakdownRow(label, None, None, None, source)
    bucket = hist.bucket_of(0.5)
    return BreakdownRow(
        label,
        _ms(hist.mean),
        None,
        hist.count,
        source,
        p50_bucket_ms=None if bucket is None else (bucket[0] * 1000.0, bucket[1] * 1000.0),
        p50_estimate_ms=_ms(hist.quantile(0.5)),
    )


def _diff(a: float | None, *rest: float | None) -> float | None:
    if a is None or any(r is None for r in rest):
        return None
    return a - sum(r for r in rest if r is not None)


def breakdown_rows(
    deltas: Mapping[str, Mapping[str, Histogram | None]],
    pd_result: Result | None,
    single_result: Result | None,
) -> list[BreakdownRow]:
    """Where the P/D time to first token goes at one concurrency.

    deltas: source ('proxy', 'prefill', 'decode', 'single') -> histogram name -> delta over the
    run (None or a missing source: not measured). Histogram rows: mean = sum/count (exact),
    p50 = bucket estimate. Client rows: vllm bench serve's own mean and median. Derived rows
    subtract means (and, for the P/D-vs-single row, medians).
    """

    def hist(source: str, name: str) -> Histogram | None:
        return deltas.get(source, {}).get(name)

    client = BreakdownRow(
        "client TTFT, P/D (vllm bench serve)",
        value(pd_result, "mean_ttft_ms"),
        value(pd_result, "median_ttft_ms"),
        value(pd_result, "completed"),
        "client",
    )
    rows = [client]
    by_name: dict[str, BreakdownRow] = {}
    for label, source, name in PD_HISTOGRAM_ROWS:
        row = _hist_row(label, source, hist(source, name))
        by_name[name + "@" + source] = row
        rows.append(row)
    prefill_leg = by_name["pd_proxy_prefill_duration_seconds@proxy"].mean_ms
    decode_ttfb = by_name["pd_proxy_decode_ttfb_seconds@proxy"].mean_ms
    prefill_e2e = by_name["vllm:e2e_request_latency_seconds@prefill"].mean_ms
    decode_ttft = by_name["vllm:time_to_first_token_seconds@decode"].mean_ms
    rows += [
        BreakdownRow(
            "prefill leg outside prefill vLLM",
            _diff(prefill_leg, prefill_e2e),
            None,
            None,
            "derived: prefill leg - prefill e2e",
        ),
        BreakdownRow(
            "decode TTFB outside decode vLLM",
            _diff(decode_ttfb, decode_ttft),
            None,
            None,
            "derived: decode TTFB - decode TTFT",
        ),
        BreakdownRow(
            "proxy own time before 1st byte",
            _diff(client.mean_ms, prefill_leg, decode_ttfb),
            None,
            None,
            "derived: client TTFT - prefill leg - decode TTFB",
        ),
    ]
    single_client = BreakdownRow(
        "client TTFT, single (vllm bench serve)",
        value(single_result, "mean_ttft_ms"),
        value(single_result, "median_ttft_ms"),
        value(single_result, "completed"),
        "client",
    )
    rows.append(single_client)
    for label, source, name in SINGLE_HISTOGRAM_ROWS:
        rows.append(_hist_row(label, source, hist(source, name)))
    rows.append(
        BreakdownRow(
            "P/D TTFT overhead vs single",
            _diff(client.mean_ms, single_client.mean_ms),
            _diff(client.p50_ms, single_client.p50_ms),
            None,
            "derived: P/D client TTFT - single client TTFT",
        )
    )
    return rows


def fmt_p50(row: BreakdownRow) -> str:
    """The exact median, or the histogram bucket holding it ('20-40', '>10000')."""
    if row.p50_bucket_ms is not None:
        low, high = row.p50_bucket_ms
        return f">{fmt_num(low)}" if math.isinf(high) else f"{fmt_num(low)}-{fmt_num(high)}"
    if row.p50_ms is None:
        return "" if row.mean_ms is not None else "n/a"
    return fmt_num(row.p50_ms)


def format_breakdown(level: int, rows: Sequence[BreakdownRow], title: str = "") -> str:
    head = f"{'where (concurrency ' + str(level) + ')':<40} {'mean ms':>9} {'p50 ms':>11} {'n':>6}"
    lines = [title] if title else []
    lines += [head, "-" * len(head)]
    for row in rows:
        count = "" if row.count is None else f"{row.count:.0f}"
        lines.append(f"{row.label:<40} {fmt_num(row.mean_ms):>9} {fmt_p50(row):>11} {count:>6}")
    lines += [
        "mean: sum/count of each histogram's delta over the run (exact). p50: for histogram",
        "rows the bucket holding the median (all a histogram knows; vLLM's request-latency",
        "buckets start at 300 ms); for client rows vllm bench serve's exact median. Derived",
        "rows subtract means (the last row's p50 subtracts the two client medians).",
        "n: observations in the run (= prompts: the warm-up requests come before the",
        "'before' scrape). n/a: metric not exported or /metrics not readable.",
    ]
    return "\n".join(lines)


def breakdown_json(level: int, rows: Sequence[BreakdownRow]) -> dict[str, Any]:
    return {"concurrency": level, "rows": [asdict(row) for row in rows]}
