"""Issue 27's tables: short prompts on single vs P/D vs P/D with --local-prefill-max-tokens, and
long prompts through that proxy vs the normal one. No I/O.

A pd-local figure counts only when the proxy's own path counter (pd_proxy_requests_total{path})
says every request of the run took the path the figure is about: local for the short prompts,
pd for the long ones. Otherwise the cells say NOT MEASURED, never a misleading ratio.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pcp_pd_kit.bench.histograms import parse_selector
from pcp_pd_kit.bench.results import markdown_table
from pcp_pd_kit.bench.tables import (
    BURSTY_ABOVE,
    REQUESTS_COUNTER,
    BreakdownRow,
    Deltas,
    Goal,
    Result,
    _diff,
    _hist_row,
    _label,
    delivery,
    fmt_num,
    fmt_p50,
    fmt_ratio,
    ratio,
    value,
)

PATH_COUNTER = REQUESTS_COUNTER
PATHS = ("local", "pd")
# At concurrency 1, TTFT of prompts below N on the pd-local proxy within this of single's.
SHORT_TTFT_LIMIT = 1.1
# Long prompts unchanged: pd-local / pd median TTFT within 1 +- this. The proxy's only extra work
# on a long prompt is one /tokenize round trip to decode (a few ms against a P/D TTFT of hundreds
# on the CPU stack); the tolerance covers the spread between two runs of the same P/D path a few
# minutes apart on a shared machine (docs/bench.md has the figures).
LONG_TOLERANCE = 0.15
METRICS: tuple[tuple[str, str], ...] = (
    ("TTFT median (ms)", "median_ttft_ms"),
    ("TTFT p99 (ms)", "p99_ttft_ms"),
    ("E2E latency median (ms)", "median_e2el_ms"),
)
Counters = Mapping[str, Mapping[str, float] | None]


@dataclass(frozen=True)
class PathCheck:
    """Which way a run's requests went through the pd-local proxy (deltas over the run).

    local/pd are None when the proxy's /metrics had no pd_proxy_requests_total (not read, or a
    proxy without the path label): then nothing is verified.
    """

    expected: str  # "local" or "pd"
    local: float | None
    pd: float | None
    completed: float | None

    @property
    def measured(self) -> bool:
        """Every completed request took the expected path and none the other."""
        if self.local is None or self.pd is None or not self.completed:
            return False
        took, other = (self.local, self.pd) if self.expected == "local" else (self.pd, self.local)
        return took >= self.completed and other == 0

    def text(self) -> str:
        if self.local is None or self.pd is None:
            return f"NOT MEASURED: no {PATH_COUNTER}{{path}} on the pd-local proxy's /metrics"
        done = "?" if self.completed is None else f"{self.completed:.0f}"
        of = f"path local {self.local:.0f}, path pd {self.pd:.0f} (of {done} completed)"
        if self.measured:
            return f"{of}: all {self.expected}"
        return f"NOT MEASURED: {of}, expected all {self.expected}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "expected": self.expected,
            "local": self.local,
            "pd": self.pd,
            "completed": self.completed,
            "measured": self.measured,
            "text": self.text(),
        }


def path_check(counters: Counters, result: Result | None, expected: str) -> PathCheck:
    """The path counts of one run on the pd-local proxy (counters: source -> selector -> delta,
    as the runner records them; the proxy's are under 'proxy')."""
    if expected not in PATHS:
        raise ValueError(f"expected path {expected!r}: one of {PATHS}")
    completed = value(result, "completed")
    series = counters.get("proxy")
    found = {path: 0.0 for path in PATHS}
    seen = False
    for key, count in (series or {}).items():
        name, labels = parse_selector(key)
        if name != PATH_COUNTER:
            continue
        seen = True
        path = labels.get("path", "")
        if path in found:
            found[path] += count
    if not seen:
        return PathCheck(expected, None, None, completed)
    return PathCheck(expected, found["local"], found["pd"], completed)


def short_rows(short: Mapping[str, Result | None], check: PathCheck | None) -> list[dict[str, Any]]:
    """Per metric: single, P/D, P/D+local (None unless the run took the local path) and the two
    ratios to single."""
    ok = check is not None and check.measured
    rows = []
    for label, key in METRICS:
        s = value(short.get("single"), key)
        p = value(short.get("pd"), key)
        loc = value(short.get("pd-local"), key) if ok else None
        rows.append(
            {
                "metric": label,
                "key": key,
                "single": s,
                "pd": p,
                "pd_local": loc,
                "pd_over_single": ratio(p, s),
                "pd_local_over_single": ratio(loc, s),
            }
        )
    return rows


def long_rows(
    pd: Result | None, pd_local: Result | None, check: PathCheck | None
) -> list[dict[str, Any]]:
    """Per metric: P/D and P/D+local on the long prompts, and P/D+local / P/D."""
    ok = check is not None and check.measured
    rows = []
    for label, key in METRICS:
        p = value(pd, key)
        loc = value(pd_local, key) if ok else None
        rows.append(
            {
                "metric": label,
                "key": key,
                "pd": p,
                "pd_local": loc,
                "pd_local_over_pd": ratio(loc, p),
            }
        )
    return rows


def _cell(number: float | None, ran: bool, result: Result | None, key: str) -> str:
    if not ran:
        return "not run"
    if number is None and value(result, key) is not None:
        return "not meas."
    return fmt_num(number)


def format_short(
    short: Mapping[str, Result | None],
    short_check: PathCheck | None,
    long_pd: Result | None,
    long_local: Result | None,
    long_check: PathCheck | None,
    *,
    input_len: int,
    long_input_len: int,
    max_tokens: int,
    ran_long_pd: bool,
) -> str:
    """The short-prompt table (three targets, ratios to single), its path line, then the long
    prompts through both proxies (Markdown)."""
    cells: list[list[object]] = []
    for row in short_rows(short, short_check):
        cells.append(
            [
                row["metric"],
                _cell(row["single"], "single" in short, short.get("single"), row["key"]),
                _cell(row["pd"], "pd" in short, short.get("pd"), row["key"]),
                _cell(row["pd_local"], "pd-local" in short, short.get("pd-local"), row["key"]),
                fmt_ratio(row["pd_over_single"]),
                fmt_ratio(row["pd_local_over_single"]),
            ]
        )
    headers = [
        f"short, {input_len} tokens, c=1",
        "single",
        "P/D",
        "P/D+local",
        "P/D/single",
        "local/single",
    ]
    lines = [markdown_table(headers, cells)]
    if "pd-local" in short:
        lines.append(
            f"\nP/D+local proxy (N={max_tokens}): {(short_check or _none('local')).text()}"
        )
    ran_local = long_local is not None or long_check is not None
    cells = [
        [
            row["metric"],
            _cell(row["pd"], ran_long_pd, long_pd, row["key"]),
            _cell(row["pd_local"], ran_local, long_local, row["key"]),
            fmt_ratio(row["pd_local_over_pd"]),
        ]
        for row in long_rows(long_pd, long_local, long_check)
    ]
    headers = [f"long, {long_input_len} tokens, c=1", "P/D", "P/D+local", "local/P/D"]
    lines += ["", markdown_table(headers, cells)]
    if ran_local:
        lines.append(f"\nP/D+local proxy (N={max_tokens}): {(long_check or _none('pd')).text()}")
    lines += [
        "",
        "P/D+local: the same prefill + decode through a third pd-proxy with",
        f"--local-prefill-max-tokens {max_tokens}: prompts of at most N tokens (counted by",
        "decode's /tokenize) go to decode alone. Its figures count only when its",
        f"{PATH_COUNTER}{{path}} delta shows every request on the expected path. Long: the",
        "main workload's prompt length through the normal proxy and this one, back to back.",
    ]
    bursts = []
    for name, result in (*short.items(), ("pd (long)", long_pd), ("pd-local (long)", long_local)):
        d = delivery(result)
        if d is not None and d.tokens_per_delivery > BURSTY_ABOVE:
            bursts.append(f"{name}: {d.tokens_per_delivery:.2f} tokens per delivery")
    if bursts:
        lines += [
            "WARNING: these runs' streams reached the client in bursts (a process short of CPU:",
            "their TTFT includes decode steps); quote their TTFT only from a quieter run:",
            *(f"  {b}" for b in bursts),
        ]
    return "\n".join(lines)


def _none(expected: str) -> PathCheck:
    return PathCheck(expected, None, None, None)


def goals(
    short: Mapping[str, Result | None],
    short_check: PathCheck | None,
    long_pd: Result | None,
    long_local: Result | None,
    long_check: PathCheck | None,
    max_tokens: int,
) -> list[Goal]:
    """Issue 27's goals: at c=1 the pd-local proxy's median TTFT on prompts below N within
    SHORT_TTFT_LIMIT x single; on long prompts within 1 +- LONG_TOLERANCE of the normal proxy."""
    out: list[Goal] = []
    text = f"TTFT median, prompts < N={max_tokens}, <= {SHORT_TTFT_LIMIT:g}x single, c=1"
    why = None
    if "pd-local" not in short:
        why = "pd-local not run"
    elif short.get("pd-local") is None:
        why = "no result"
    elif short.get("single") is None:
        why = "single not run"
    elif short_check is None or not short_check.measured:
        why = "NOT MEASURED: local path not taken"
    if why:
        out.append(Goal(text, "pd-local", 1, why, None, limit=SHORT_TTFT_LIMIT))
    else:
        loc = value(short["pd-local"], "median_ttft_ms")
        s = value(short["single"], "median_ttft_ms")
        r = ratio(loc, s)
        measured = "n/a" if r is None else f"{fmt_num(loc)} / {fmt_num(s)} ms = {fmt_ratio(r)}"
        met = None if r is None else r <= SHORT_TTFT_LIMIT
        out.append(Goal(text, "pd-local", 1, measured, met, r, SHORT_TTFT_LIMIT))
    low, high = 1 - LONG_TOLERANCE, 1 + LONG_TOLERANCE
    text = f"long prompts unchanged: TTFT median {low:g}-{high:g}x P/D, c=1"
    why = None
    if long_local is None:
        why = "pd-local not run" if long_check is None else "no result"
    elif long_pd is None:
        why = "P/D (long) not run"
    elif long_check is None or not long_check.measured:
        why = "NOT MEASURED: P/D path not taken"
    if why:
        out.append(Goal(text, "pd-local", 1, why, None, limit=high))
        return out
    loc = value(long_local, "median_ttft_ms")
    p = value(long_pd, "median_ttft_ms")
    r = ratio(loc, p)
    measured = "n/a" if r is None else f"{fmt_num(loc)} / {fmt_num(p)} ms = {fmt_ratio(r)}"
    out.append(
        Goal(text, "pd-local", 1, measured, None if r is None else low <= r <= high, r, high)
    )
    return out


TTFT_SECONDS = "vllm:time_to_first_token_seconds"
PROXY_TTFB_SECONDS = "pd_proxy_time_to_first_byte_seconds"


def _client_row(label: str, result: Result | None) -> BreakdownRow:
    return BreakdownRow(
        label,
        value(result, "mean_ttft_ms"),
        value(result, "median_ttft_ms"),
        value(result, "completed"),
        "client",
    )


def time_rows(
    deltas: Mapping[str, Deltas], short: Mapping[str, Result | None]
) -> list[BreakdownRow]:
    """Where the short prompts' time to first token goes, single vs P/D+local (the local path).

    deltas: target -> source -> histogram -> delta over that target's short run. The decode's
    own TTFT (arrival -> first token, its prefill of the prompt included) against the single
    instance's, and what the proxy adds around it: counting the prompt (decode's /tokenize), the
    decode leg's HTTP and the relay.
    """

    def hist(target: str, source: str, name: str) -> BreakdownRow:
        return _hist_row("", source, deltas.get(target, {}).get(source, {}).get(name))

    single = _client_row("single: client TTFT", short.get("single"))
    single_server = hist("single", "single", TTFT_SECONDS)
    local = _client_row("P/D+local: client TTFT", short.get("pd-local"))
    ttfb = hist("pd-local", "proxy", PROXY_TTFB_SECONDS)
    decode = hist("pd-local", "decode", TTFT_SECONDS)
    named = [
        single,
        BreakdownRow("  single vLLM: TTFT", **_fields(single_server)),
        local,
        BreakdownRow("  proxy: client TTFB", **_fields(ttfb)),
        BreakdownRow("  decode vLLM: TTFT (its own prefill)", **_fields(decode)),
        BreakdownRow(
            "  proxy around decode (/tokenize, legs)",
            _diff(ttfb.mean_ms, decode.mean_ms),
            None,
            None,
            "derived: proxy TTFB - decode TTFT",
        ),
        BreakdownRow(
            "decode TTFT - single vLLM TTFT",
            _diff(decode.mean_ms, single_server.mean_ms),
            None,
            None,
            "derived: the two servers' own TTFT",
        ),
        BreakdownRow(
            "P/D+local - single, client TTFT",
            _diff(local.mean_ms, single.mean_ms),
            _diff(local.p50_ms, single.p50_ms),
            None,
            "derived: client TTFTs",
        ),
    ]
    return named


def _fields(row: BreakdownRow) -> dict[str, Any]:
    return {
        "mean_ms": row.mean_ms,
        "p50_ms": row.p50_ms,
        "count": row.count,
        "source": row.source,
        "p50_bucket_ms": row.p50_bucket_ms,
        "p50_estimate_ms": row.p50_estimate_ms,
    }


def format_time_rows(rows: Sequence[BreakdownRow]) -> str:
    cells = [
        [
            _label(row.label),
            fmt_num(row.mean_ms),
            fmt_p50(row),
            "" if row.count is None else f"{row.count:.0f}",
        ]
        for row in rows
    ]
    headers = ["short prompts, c=1: where TTFT goes", "mean ms", "p50 ms", "n"]
    return "\n".join(
        [
            markdown_table(headers, cells),
            "",
            "mean: sum/count of each histogram's delta over the run; p50: the client's exact "
            "median,",
            "or the histogram bucket holding it. Derived rows subtract means.",
        ]
    )


def format_goals(found: Sequence[Goal]) -> str:
    cells = [[g.goal, g.measured, g.verdict] for g in found]
    return "\n".join(
        [
            markdown_table(["goal (issue 27)", "measured", "result"], cells),
            "",
            "TTFT: vllm bench serve's median; short: P/D+local / single on the short prompts; "
            "long:",
            "P/D+local / P/D on the main workload's prompts. Reported only: never a failure.",
        ]
    )
