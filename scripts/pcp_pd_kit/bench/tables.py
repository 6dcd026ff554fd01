"""The side-by-side table (single vs P/D per concurrency) and the P/D overhead breakdown.

Inputs are `vllm bench serve` result JSONs (its own keys: median_ttft_ms, p99_ttft_ms, ...) and
histogram deltas; outputs are plain text and JSON-ready dicts. No I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pcp_nixl_connector.handover import DECODE_PHASES
from pcp_nixl_connector.metric_names import HANDOVER_SECONDS, KV_LEASE_SECONDS
from pcp_pd_kit.bench.histograms import Histogram, parse_selector, selector
from pcp_pd_kit.bench.results import markdown_table

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
    """One dict per (level, metric): single, pd and their ratio, for the table and result.json."""
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


def _label(text: str) -> str:
    """A row label for a Markdown cell: its indentation (a sub-row) kept as a leading dot."""
    stripped = text.lstrip()
    return f"· {stripped}" if stripped != text else text


def format_table(
    results: Mapping[tuple[str, int], Result | None],
    levels: Sequence[int],
    prompts: Sequence[int],
    title: str = "",
) -> str:
    """The side-by-side table (Markdown); a level or target that did not run shows n/a."""
    rows = comparison_rows(results, levels)
    cells: list[list[object]] = []
    for level, count in zip(levels, prompts, strict=True):
        done = [
            completed_text(results[(t, level)], count) if (t, level) in results else "not run"
            for t in ("single", "pd")
        ]
        cells.append([level, "completed", done[0], done[1], ""])
        per = [delivery(results.get((t, level))) for t in ("single", "pd")]
        bursty = [d is not None and d.tokens_per_delivery > BURSTY_ABOVE for d in per]
        for row in (r for r in rows if r["concurrency"] == level):
            mark = ["*" if b and row["key"] in BURST_AFFECTED else "" for b in bursty]
            cells.append(
                [
                    "",
                    row["metric"],
                    fmt_num(row["single"]) + mark[0],
                    fmt_num(row["pd"]) + mark[1],
                    fmt_ratio(row["pd_over_single"]) + max(mark),
                ]
            )
        delivered = [fmt_num(d.tokens_per_delivery if d else None) for d in per]
        cells.append(["", "tokens per delivery", delivered[0], delivered[1], ""])
    lines = [title, ""] if title else []
    lines.append(markdown_table(["c", "metric", "single", "P/D", "P/D/single"], cells))
    lines.append(
        "\nP/D/single: above 1.00x is slower for latencies (ms), faster for throughputs (/s)."
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


def handover_selector(phase: str) -> str:
    """The connector's handover histogram restricted to one phase."""
    return selector(HANDOVER_SECONDS, {"phase": phase})


FIRST_TOKEN_COUNTER = "pd_proxy_first_token_requests_total"
REQUESTS_COUNTER = "pd_proxy_requests_total"  # by path: pd, or local (decode alone)
ITL_SECONDS = "vllm:inter_token_latency_seconds"  # vLLM's decode step, as its clients see it
XFER_SECONDS = "vllm:nixl_xfer_time_seconds"
PREFILL_HOLD = "prefill_kv_hold"
OVERALL_PHASE = "admitted_to_first_token"
# Decode phases in the order they happen (the connector's names), then the overall one.
HANDOVER_PHASE_LABELS: dict[str, str] = {
    "admitted_to_read_posted": "decode: admitted -> read posted",
    "read_posted_to_transfer_done": "decode: read posted -> transfer done",
    "transfer_done_to_scheduler": "decode: transfer done -> scheduler",
    "scheduler_to_first_token": "decode: scheduler -> first token",
    OVERALL_PHASE: "decode: admitted -> first token (all)",
}
assert tuple(HANDOVER_PHASE_LABELS) == DECODE_PHASES, "the connector's decode phases changed"
# (label, source, histogram or selector) of the handover table, per P/D mode.
HANDOVER_HISTOGRAM_ROWS: tuple[tuple[str, str, str], ...] = (
    ("proxy: client TTFB (received -> 1st byte)", "proxy", "pd_proxy_time_to_first_byte_seconds"),
    ("proxy: prefill leg", "proxy", "pd_proxy_prefill_duration_seconds"),
    ("proxy: decode TTFB", "proxy", "pd_proxy_decode_ttfb_seconds"),
    *(
        (label, "decode", handover_selector(phase))
        for phase, label in HANDOVER_PHASE_LABELS.items()
    ),
    ("  NIXL transfer (per xfer)", "decode", XFER_SECONDS),
    ("  decode step (vLLM inter-token latency)", "decode", ITL_SECONDS),
    ("prefill: KV hold, done -> freed", "prefill", handover_selector(PREFILL_HOLD)),
)
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
    """Source ('proxy', 'prefill', 'decode', 'single') -> the histograms to read from it (names,
    or selectors such as 'vllm:nixl_handover_seconds{phase="prefill_kv_hold"}')."""
    wanted: dict[str, tuple[str, ...]] = {}
    rows = PD_HISTOGRAM_ROWS + SINGLE_HISTOGRAM_ROWS + HANDOVER_HISTOGRAM_ROWS
    for _label, source, name in rows:
        if name not in wanted.get(source, ()):
            wanted[source] = wanted.get(source, ()) + (name,)
    return wanted


def counter_metrics() -> dict[str, tuple[tuple[str, tuple[str, ...]], ...]]:
    """Source -> (counter as exposed, labels kept): the first-token proxy's outcomes and the
    proxy's requests by path (pd, local: the local-prefill proxy's check)."""
    return {
        "proxy": (
            (FIRST_TOKEN_COUNTER, ("outcome", "reason")),
            (REQUESTS_COUNTER, ("path",)),
        )
    }


def gauge_metrics() -> dict[str, tuple[str, ...]]:
    """Source -> gauges read after each run: the prefill's configured KV lease."""
    return {"prefill": (KV_LEASE_SECONDS,)}


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
    lines = [title, ""] if title else []
    lines.append(
        markdown_table(
            [f"where (concurrency {level})", "mean ms", "p50 ms", "n"],
            [
                [
                    _label(row.label),
                    fmt_num(row.mean_ms),
                    fmt_p50(row),
                    "" if row.count is None else f"{row.count:.0f}",
                ]
                for row in rows
            ],
        )
    )
    lines += [
        "",
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


# --- the handover breakdown, the P/D modes side by side, the goals ----------------------------
PD_MODES = ("pd", "pd-ft")  # P/D through pd-proxy; the same through a first-token pd-proxy
MODE_COLUMNS = {"single": "single", "pd": "P/D", "pd-ft": "P/D 1st-tok", "pd-local": "P/D+local"}
Deltas = Mapping[str, Mapping[str, Histogram | None]]
Counters = Mapping[str, Mapping[str, float] | None]
Gauges = Mapping[str, Mapping[str, float | None]]


@dataclass(frozen=True)
class FirstTokenCheck:
    """Did the first-token proxy really serve the run's requests from prefill's token 1?

    From the delta of pd_proxy_first_token_requests_total over the run: continued (token 1 from
    prefill, decode continued), finished (token 1 ended the request), normal (the normal flow, by
    reason). continued is None when the proxy's /metrics had no such counter (not that mode, or
    not readable): then nothing is verified.
    """

    continued: float | None
    finished: float = 0.0
    normal: Mapping[str, float] | None = None
    completed: float | None = None

    @property
    def measured(self) -> bool:
        """Only a run in which the proxy continued requests measured the mode."""
        return self.continued is not None and self.continued > 0

    @property
    def normal_total(self) -> float:
        return sum((self.normal or {}).values())

    def text(self) -> str:
        if self.continued is None:
            return "NOT MEASURED: no pd_proxy_first_token_requests_total on the proxy's /metrics"
        total = self.continued + self.finished + self.normal_total
        of = f"{self.continued:.0f}/{total:.0f} continued from token 1"
        if self.finished:
            of += f", {self.finished:.0f} ended by token 1"
        if self.normal:
            reasons = ", ".join(f"{k or '?'} {v:.0f}" for k, v in sorted(self.normal.items()))
            of += f", {self.normal_total:.0f} normal flow ({reasons})"
        return of if self.measured else f"NOT MEASURED: {of}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "continued": self.continued,
            "finished": self.finished,
            "normal": dict(self.normal or {}),
            "completed": self.completed,
            "measured": self.measured,
            "text": self.text(),
        }


def first_token_check(counters: Counters, result: Result | None) -> FirstTokenCheck:
    """The first-token outcome counts of one run (counters: source -> selector -> delta)."""
    series = counters.get("proxy")
    completed = value(result, "completed")
    if not series:
        return FirstTokenCheck(None, completed=completed)
    continued = finished = 0.0
    normal: dict[str, float] = {}
    for key, count in series.items():
        name, labels = parse_selector(key)
        if name != FIRST_TOKEN_COUNTER:
            continue
        outcome = labels.get("outcome", "")
        if outcome == "continued":
            continued += count
        elif outcome == "finished":
            finished += count
        elif count:
            reason = labels.get("reason", "")
            normal[reason] = normal.get(reason, 0.0) + count
    return FirstTokenCheck(continued, finished, normal, completed)


def handover_rows(
    deltas: Deltas, result: Result | None, gauges: Gauges | None = None
) -> list[BreakdownRow]:
    """Where one P/D mode's time to first token goes, per handover phase, at one concurrency.

    Histogram rows as in breakdown_rows (mean = sum/count of the delta, p50 = bucket); the client
    row is vllm bench serve's own; "decode TTFB outside the handover" subtracts means.
    """
    rows = [
        BreakdownRow(
            "client TTFT (vllm bench serve)",
            value(result, "mean_ttft_ms"),
            value(result, "median_ttft_ms"),
            value(result, "completed"),
            "client",
        )
    ]
    lease = (gauges or {}).get("prefill", {}).get(KV_LEASE_SECONDS)
    by_name: dict[str, BreakdownRow] = {}
    for label, source, name in HANDOVER_HISTOGRAM_ROWS:
        if name == handover_selector(PREFILL_HOLD) and lease is not None:
            label = f"{label} (lease {lease:g} s)"
        row = _hist_row(label, source, deltas.get(source, {}).get(name))
        by_name[name] = row
        rows.append(row)
    decode_ttfb = by_name["pd_proxy_decode_ttfb_seconds"].mean_ms
    overall = by_name[handover_selector(OVERALL_PHASE)].mean_ms
    rows.insert(
        len(rows) - 1,
        BreakdownRow(
            "decode TTFB outside the handover",
            _diff(decode_ttfb, overall),
            None,
            None,
            "derived: decode TTFB - decode admitted -> first token",
        ),
    )
    return rows


def format_handover(
    level: int, per_mode: Mapping[str, Sequence[BreakdownRow]], title: str = ""
) -> str:
    """The handover rows of each P/D mode side by side: mean, p50 (bucket), n per mode."""
    modes = [m for m in PD_MODES if m in per_mode]
    if not modes:
        return ""
    headers = [f"handover, concurrency {level}"]
    for mode in modes:
        name = MODE_COLUMNS[mode]
        headers += [f"{name} mean ms", f"{name} p50 ms", f"{name} n"]
    cells: list[list[object]] = []
    for index, row in enumerate(per_mode[modes[0]]):
        line: list[object] = [_label(row.label)]
        for mode in modes:
            cell = per_mode[mode][index]
            count = "" if cell.count is None else f"{cell.count:.0f}"
            line += [fmt_num(cell.mean_ms), fmt_p50(cell), count]
        cells.append(line)
    lines = [title, ""] if title else []
    lines += [
        markdown_table(headers, cells),
        "",
        "decode phases: vllm:nixl_handover_seconds{phase} on decode (the kit's connector, one",
        "host clock): admitted (waiting for remote KV) -> read posted (the worker got the read)",
        "-> transfer done -> seen by the scheduler -> first token (end of its first step). For",
        "P/D 1st-tok the decode leg is the continuation, off the client's path to token 1.",
        "mean: sum/count of the run's delta (exact); p50: the bucket holding the median; n: count.",
    ]
    return "\n".join(lines)


def handover_json(level: int, per_mode: Mapping[str, Sequence[BreakdownRow]]) -> dict[str, Any]:
    return {
        "concurrency": level,
        "modes": {mode: [asdict(row) for row in rows] for mode, rows in per_mode.items()},
    }


# --- the P/D modes against the single instance ---
MODE_METRICS: tuple[tuple[str, str], ...] = (
    ("TTFT median (ms)", "median_ttft_ms"),
    ("TTFT p99 (ms)", "p99_ttft_ms"),
    ("E2E latency median (ms)", "median_e2el_ms"),
)


def mode_rows(
    results: Mapping[tuple[str, int], Result | None],
    levels: Sequence[int],
    checks: Mapping[int, FirstTokenCheck],
) -> list[dict[str, Any]]:
    """Per (level, metric): single, P/D, P/D first token and the two ratios to single. A
    first-token run whose proxy continued no request is not a measurement: its cells are None."""
    rows = []
    for level in levels:
        check = checks.get(level)
        ft_ok = check is not None and check.measured
        for label, key in MODE_METRICS:
            s = value(results.get(("single", level)), key)
            p = value(results.get(("pd", level)), key)
            f = value(results.get(("pd-ft", level)), key) if ft_ok else None
            rows.append(
                {
                    "concurrency": level,
                    "metric": label,
                    "key": key,
                    "single": s,
                    "pd": p,
                    "pd_ft": f,
                    "pd_over_single": ratio(p, s),
                    "pd_ft_over_single": ratio(f, s),
                }
            )
    return rows


def format_modes(
    results: Mapping[tuple[str, int], Result | None],
    levels: Sequence[int],
    checks: Mapping[int, FirstTokenCheck],
) -> str:
    rows = mode_rows(results, levels, checks)
    cells: list[list[object]] = []
    for level in levels:
        ran_ft = ("pd-ft", level) in results
        for index, row in enumerate(r for r in rows if r["concurrency"] == level):
            ft = fmt_num(row["pd_ft"]) if ran_ft else "not run"
            if ran_ft and row["pd_ft"] is None and value(results[("pd-ft", level)], row["key"]):
                ft = "not meas."
            cells.append(
                [
                    level if index == 0 else "",
                    row["metric"],
                    fmt_num(row["single"]),
                    fmt_num(row["pd"]),
                    ft,
                    fmt_ratio(row["pd_over_single"]),
                    fmt_ratio(row["pd_ft_over_single"]),
                ]
            )
        if ran_ft:
            check = checks.get(level) or FirstTokenCheck(None)
            cells.append(["", f"first-token proxy: {check.text()}", "", "", "", "", ""])
    headers = ["c", "metric", "single", "P/D", "P/D 1st-tok", "P/D/single", "1st-tok/single"]
    return "\n".join(
        [
            markdown_table(headers, cells),
            "",
            "1st-tok: the same prefill + decode through a second pd-proxy with "
            "--first-token-from-prefill;",
            "its figures count only when that proxy continued requests "
            "(pd_proxy_first_token_requests_total).",
        ]
    )


# --- the goals (issue 19): reported, never a failure ---
TTFT_GOALS: tuple[tuple[int, float], ...] = ((1, 1.2), (4, 1.5))  # (concurrency, max P/D/single)
HANDOVER_GOAL_LEVELS = (1, 4)
HANDOVER_SLACK_MS = 5.0


@dataclass(frozen=True)
class Goal:
    """One goal for one P/D mode at one concurrency: met True/False, or None (not measured)."""

    goal: str
    mode: str
    concurrency: int
    measured: str
    met: bool | None
    value: float | None = None
    limit: float | None = None

    @property
    def verdict(self) -> str:
        return {True: "met", False: "NOT MET", None: "n/a"}[self.met]


def _handover_budget(deltas: Deltas) -> tuple[float | None, float | None, str]:
    """(admitted -> first token mean ms, transfer + one decode step + slack ms, how)."""
    decode = deltas.get("decode", {})
    overall = decode.get(handover_selector(OVERALL_PHASE))
    xfer, step = decode.get(XFER_SECONDS), decode.get(ITL_SECONDS)
    measured = _ms(overall.mean) if overall is not None else None
    if overall is None or not overall.count or xfer is None or step is None or step.mean is None:
        missing = [
            name
            for name, hist in (("handover", overall), ("NIXL transfer", xfer), ("ITL", step))
            if hist is None or not hist.count
        ]
        return measured, None, f"no {', '.join(missing)} observations"
    transfer_ms = xfer.sum * 1000.0 / overall.count  # per request handed over
    step_ms = step.mean * 1000.0
    budget = transfer_ms + step_ms + HANDOVER_SLACK_MS
    how = (
        f"{fmt_num(measured)} vs {fmt_num(transfer_ms)} + {fmt_num(step_ms)} + "
        f"{HANDOVER_SLACK_MS:g} = {fmt_num(budget)} ms"
    )
    return measured, budget, how


def goals(
    results: Mapping[tuple[str, int], Result | None],
    deltas: Mapping[tuple[str, int], Deltas],
    checks: Mapping[int, FirstTokenCheck],
) -> list[Goal]:
    """Issue 19's goals for each P/D mode: median TTFT <= 1.2x single at concurrency 1 and <=
    1.5x at 4; decode admitted -> first token (mean) <= NIXL transfer per request + one decode
    step (decode's mean inter-token latency) + 5 ms, at concurrency 1 and 4."""
    out: list[Goal] = []

    def unmeasured(mode: str, level: int) -> str | None:
        if (mode, level) not in results:
            return f"c={level} not run"
        if results[(mode, level)] is None:
            return "no result"
        if mode == "pd-ft" and not (checks.get(level) and checks[level].measured):
            return "not measured: nothing continued"
        return None

    modes = [m for m in PD_MODES if any(t == m for t, _ in results)]
    for level, limit in TTFT_GOALS:
        text = f"TTFT median <= {limit:g}x single, c={level}"
        for mode in modes:
            why = unmeasured(mode, level) or (
                None if results.get(("single", level)) else "single not run"
            )
            if why:
                out.append(Goal(text, mode, level, why, None, limit=limit))
                continue
            p = value(results[(mode, level)], "median_ttft_ms")
            s = value(results[("single", level)], "median_ttft_ms")
            r = ratio(p, s)
            measured = "n/a" if r is None else f"{fmt_num(p)} / {fmt_num(s)} ms = {fmt_ratio(r)}"
            out.append(
                Goal(text, mode, level, measured, None if r is None else r <= limit, r, limit)
            )
    for level in HANDOVER_GOAL_LEVELS:
        text = f"handover <= xfer + step + {HANDOVER_SLACK_MS:g} ms, c={level}"
        for mode in modes:
            why = unmeasured(mode, level)
            if why:
                out.append(Goal(text, mode, level, why, None))
                continue
            took, budget, how = _handover_budget(deltas.get((mode, level), {}))
            met = None if took is None or budget is None else took <= budget
            out.append(Goal(text, mode, level, how, met, took, budget))
    return out


def format_goals(found: Sequence[Goal]) -> str:
    cells: list[list[object]] = []
    previous = ""
    for g in found:
        cells.append(
            [g.goal if g.goal != previous else "", MODE_COLUMNS[g.mode], g.measured, g.verdict]
        )
        previous = g.goal
    return "\n".join(
        [
            markdown_table(["goal (issue 19)", "mode", "measured", "result"], cells),
            "",
            "TTFT: vllm bench serve's median, P/D mode / single. handover: decode's mean",
            "admitted -> first token vs NIXL transfer time per request handed over",
            "(vllm:nixl_xfer_time_seconds sum / n) + one decode step (decode's mean",
            "vllm:inter_token_latency_seconds) + 5 ms.",
            "Reported only: a goal not met never fails the run.",
        ]
    )


def goals_json(found: Sequence[Goal]) -> list[dict[str, Any]]:
    return [{**asdict(g), "verdict": g.verdict} for g in found]
