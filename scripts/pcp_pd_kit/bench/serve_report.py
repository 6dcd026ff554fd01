"""The serve bench's report (no I/O): per workload the targets, their ratios to the reference, where
TTFT goes, the goals; a P/D variant's figure counts only if its proxy's counters show its mode."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pcp_nixl_connector.handover import DECODE_PHASES
from pcp_nixl_connector.metric_names import HANDOVER_SECONDS, KV_LEASE_SECONDS
from pcp_pd_kit.bench import tables
from pcp_pd_kit.bench.metrics import REQUESTS_COUNTER, Histogram, paths, selector, series
from pcp_pd_kit.bench.serve_plan import LONG, MAIN, SHORT, TARGET_TITLES, BenchPlan, ShortPlan
from pcp_pd_kit.bench.tables import VERDICT, fmt_num, fmt_ratio, markdown_table, ratio, value

Result = Mapping[str, Any]
# (row label, key in vllm bench serve's result JSON)
METRICS: tuple[tuple[str, str], ...] = (
    ("TTFT median (ms)", "median_ttft_ms"), ("TTFT p99 (ms)", "p99_ttft_ms"),
    ("TPOT median (ms)", "median_tpot_ms"), ("ITL median (ms)", "median_itl_ms"),
    ("E2E latency median (ms)", "median_e2el_ms"), ("requests/s", "request_throughput"),
    ("output tokens/s", "output_throughput"),
)  # fmt: skip
# workload -> (reference target, the targets compared with it), in column order
WORKLOADS: dict[str, tuple[str, tuple[str, ...]]] = {
    MAIN: ("single", ("pd", "pd-ft")),
    SHORT: ("single", ("pd", "pd-local")),
    LONG: ("pd", ("pd-local",)),
}
WORKLOAD_NAMES = {MAIN: "main", SHORT: "short", LONG: "long"}
BURST_GAP_S = 0.0005  # SSE messages closer than this reached the client in the same read
BURSTY_ABOVE = 1.1  # tokens per delivery above which TTFT/TPOT/ITL are flagged
BURST_AFFECTED = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "median_itl_ms")
FIRST_TOKEN_COUNTER = "pd_proxy_first_token_requests_total"
TTFT_SECONDS = "vllm:time_to_first_token_seconds"
PHASE_LABELS: dict[str, str] = {
    "admitted_to_read_posted": "decode: admitted -> read posted",
    "read_posted_to_transfer_done": "decode: read posted -> transfer done",
    "transfer_done_to_scheduler": "decode: transfer done -> scheduler",
    "scheduler_to_first_token": "decode: scheduler -> first token",
    "admitted_to_first_token": "decode: admitted -> first token (all)",
}
assert tuple(PHASE_LABELS) == DECODE_PHASES, "the connector's decode phases changed"
PREFILL_HOLD = selector(HANDOVER_SECONDS, {"phase": "prefill_kv_hold"})
HANDOVER_ALL = selector(HANDOVER_SECONDS, {"phase": "admitted_to_first_token"})
# (label, source, histogram or selector); source "server" is the single vLLM, or P/D's decode
BREAKDOWN: tuple[tuple[str, str, str], ...] = (
    ("proxy: client TTFB", "proxy", "pd_proxy_time_to_first_byte_seconds"),
    ("proxy: prefill leg", "proxy", "pd_proxy_prefill_duration_seconds"),
    ("· prefill vLLM: request e2e", "prefill", "vllm:e2e_request_latency_seconds"),
    ("proxy: decode TTFB", "proxy", "pd_proxy_decode_ttfb_seconds"),
    ("vLLM TTFT (single, or decode)", "server", TTFT_SECONDS),
    *((lb, "server", selector(HANDOVER_SECONDS, {"phase": p})) for p, lb in PHASE_LABELS.items()),
    ("· NIXL transfer (per xfer)", "server", "vllm:nixl_xfer_time_seconds"),
    ("· decode step (inter-token latency)", "server", "vllm:inter_token_latency_seconds"),
    ("prefill: KV hold, done -> freed", "prefill", PREFILL_HOLD),
)
# source -> the histograms (names or selectors) the breakdown reads from it
HISTOGRAMS = {s: tuple(n for _l, src, n in BREAKDOWN if src == s) for _l, s, _n in BREAKDOWN}
# vLLM's prefix-cache counters (tokens looked up, tokens found) on each vLLM of a run
PREFIX_QUERIES, PREFIX_HITS = "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"
CACHE_COUNTERS = ((PREFIX_QUERIES, ()), (PREFIX_HITS, ()))
COUNTERS = {
    "proxy": ((FIRST_TOKEN_COUNTER, ("outcome", "reason")), (REQUESTS_COUNTER, ("path",))),
    "prefill": CACHE_COUNTERS, "server": CACHE_COUNTERS,
}  # fmt: skip
CACHE_SOURCES = {"prefill": "prefill", "server": "decode"}  # what a P/D run calls each source
GAUGES = {"prefill": (KV_LEASE_SECONDS,)}
# (workload, target, concurrency, lowest, highest) of target / reference median TTFT
GOALS: tuple[tuple[str, str, int, float | None, float], ...] = (
    (MAIN, "pd", 1, None, 1.2), (MAIN, "pd", 4, None, 1.5), (MAIN, "pd-ft", 1, None, 1.2),
    (MAIN, "pd-ft", 4, None, 1.5), (SHORT, "pd-local", 1, None, 1.1),
    (LONG, "pd-local", 1, 0.85, 1.15),  # long prompts unchanged: the proxy only counts them
)  # fmt: skip


@dataclass
class Run:
    """One `vllm bench serve` of one target, workload and concurrency, and what it left."""

    target: str
    level: int
    prompts: int
    workload: str = MAIN
    result: dict[str, Any] | None = None
    deltas: dict[str, dict[str, Histogram | None]] = field(default_factory=dict)
    counters: dict[str, dict[str, float] | None] = field(default_factory=dict)
    gauges: dict[str, dict[str, float | None]] = field(default_factory=dict)
    returncode: int | None = None
    seconds: float = 0.0
    timed_out: bool = False
    log: str = ""

    @property
    def name(self) -> str:
        suffix = f" ({self.workload})" if self.workload else ""
        return f"{TARGET_TITLES[self.target]}{suffix} c={self.level}"

    @property
    def complete(self) -> bool:
        done = value(self.result, "completed")
        return self.returncode == 0 and done is not None and int(done) == self.prompts

    def hit_rates(self) -> dict[str, float | None]:
        """Each vLLM's prefix-cache hit rate during the run (hit tokens / looked-up tokens): a
        figure helped by prompts an earlier run left in the cache shows here, not as speed."""
        names = {"server": "server"} if self.target == "single" else CACHE_SOURCES
        return {name: hit_rate(self.counters.get(src)) for src, name in names.items()}

    def summary(self) -> dict[str, Any]:
        d = delivery(self.result)
        return {"target": self.target, "workload": WORKLOAD_NAMES[self.workload],
                "concurrency": self.level, "prompts": self.prompts,
                "returncode": self.returncode, "seconds": round(self.seconds, 1),
                "timed_out": self.timed_out, "complete": self.complete,
                "delivery": None if d is None else asdict(d), "counters": self.counters,
                "gauges": self.gauges, "prefix_cache_hit_rate": self.hit_rates(),
                "log": self.log}  # fmt: skip


def hit_rate(counters: Mapping[str, float] | None) -> float | None:
    """hits / queries of the prefix-cache counters grown over a run (None: unread, no query)."""
    queries = (counters or {}).get(PREFIX_QUERIES)
    return None if not queries else (counters or {}).get(PREFIX_HITS, 0.0) / queries


def _hit_rates(run: Run) -> str:
    text = {n: "n/a" if r is None else f"{r:.1%}" for n, r in run.hit_rates().items()}
    return " / ".join(text.values() if len(text) == 1 else (f"{n} {t}" for n, t in text.items()))


@dataclass(frozen=True)
class Delivery:
    """How a run's streams reached the client (from a --save-detailed result)."""

    tokens_per_delivery: float  # 1.0: every token arrived on its own, what TTFT/TPOT/ITL assume
    one_piece: int  # requests of more than one token that arrived all at once
    requests: int


def delivery(result: Result | None) -> Delivery | None:
    """Output tokens per arrival, a message more than BURST_GAP_S after the previous one (no
    decode step is that fast); None without per-request ITLs (--save-detailed)."""
    itls, outs = (result or {}).get("itls"), (result or {}).get("output_lens")
    if not isinstance(itls, list) or not isinstance(outs, list) or len(itls) != len(outs):
        return None
    tokens = arrivals = one_piece = requests = 0
    for itl, out in zip(itls, outs, strict=True):
        if not isinstance(out, int) or out <= 0 or not isinstance(itl, list):
            continue  # a failed request
        gaps = sum(1 for gap in itl if isinstance(gap, (int, float)) and gap >= BURST_GAP_S)
        tokens, arrivals, requests = tokens + out, arrivals + 1 + gaps, requests + 1
        one_piece += int(out > 1 and gaps == 0)
    return Delivery(tokens / arrivals, one_piece, requests) if arrivals else None


def bursty(result: Result | None) -> bool:
    d = delivery(result)
    return d is not None and d.tokens_per_delivery > BURSTY_ABOVE


@dataclass(frozen=True)
class Check:
    """Whether a run measured what its column is about, from its proxy's counter deltas."""

    measured: bool
    text: str
    counts: Mapping[str, float] | None = None


def first_token_check(run: Run) -> Check:
    """Did the proxy continue the run's requests from prefill's token 1 (outcome continued)?"""
    found = series(run.counters.get("proxy"), FIRST_TOKEN_COUNTER)
    if not found:
        return Check(False, f"NOT MEASURED: no {FIRST_TOKEN_COUNTER} on the proxy's /metrics")
    counts: dict[str, float] = {}
    for labels, n in found:
        outcome = labels.get("outcome", "")
        if outcome not in ("continued", "finished"):
            outcome = f"normal flow ({labels.get('reason') or '?'})"
        counts[outcome] = counts.get(outcome, 0.0) + n
    counts = {k: v for k, v in sorted(counts.items()) if v}
    text = ", ".join(f"{k} {v:.0f}" for k, v in counts.items()) or "no request"
    measured = counts.get("continued", 0.0) > 0
    return Check(measured, ("" if measured else "NOT MEASURED: ") + text, counts)


def path_check(run: Run, expected: str) -> Check:
    """Did every completed request of the run take `expected` (local or pd) and none the other?"""
    if not series(run.counters.get("proxy"), REQUESTS_COUNTER):
        return Check(False, f"NOT MEASURED: no {REQUESTS_COUNTER}{{path}} on the proxy's /metrics")
    counts = paths(run.counters.get("proxy"))
    done = value(run.result, "completed")
    other = "pd" if expected == "local" else "local"
    measured = bool(done) and counts[expected] >= (done or 0) and counts[other] == 0
    text = f"path local {counts['local']:.0f}, pd {counts['pd']:.0f} of {done or 0:.0f} completed"
    text = f"{text}: all {expected}" if measured else f"NOT MEASURED: {text}"
    return Check(measured, text, counts)


def check(run: Run) -> Check | None:
    """The check of a P/D variant's run; None for single and the normal P/D proxy."""
    if run.target == "pd-ft":
        return first_token_check(run)
    if run.target == "pd-local":
        return path_check(run, "local" if run.workload == SHORT else "pd")
    return None


def counted(run: Run | None) -> Result | None:
    """The run's result when its figures count (it ran and its check, if any, held)."""
    found = None if run is None else check(run)
    return None if run is None or (found and not found.measured) else run.result


Runs = Mapping[tuple[str, str, int], Run]  # (workload, target, level) -> run


def table_rows(runs: Runs, workload: str) -> list[dict[str, Any]]:
    """Per (level, metric): each target's figure (None: not measured) and ratio to reference."""
    ref, others = WORKLOADS[workload]
    rows = []
    for lv in sorted({lv for (w, _t, lv) in runs if w == workload}):
        for label, key in METRICS:
            values = {t: value(counted(runs.get((workload, t, lv))), key) for t in (ref, *others)}
            ratios = {t: ratio(values[t], values[ref]) for t in others}
            rows.append({"concurrency": lv, "metric": label, "key": key, "values": values,
                         "ratios": ratios})  # fmt: skip
    return rows


def _completed(run: Run) -> str:
    done, failed = value(run.result, "completed"), value(run.result, "failed") or 0
    if run.result is None:
        return "no result"
    text = f"{int(done or 0)}/{run.prompts}"
    return f"{text} ({int(failed)} failed)" if failed else text


def format_table(runs: Runs, workload: str) -> str:
    ref, others = WORKLOADS[workload]
    mine = [r for (w, _t, _lv), r in sorted(runs.items()) if w == workload]
    ran = [t for t in (ref, *others) if any(r.target == t for r in mine)]
    compared = [t for t in others if t in ran]
    headers = ["c", "metric", *(TARGET_TITLES[t] for t in ran)]
    headers += [f"{TARGET_TITLES[t]}/{TARGET_TITLES[ref]}" for t in compared]
    cells: list[list[object]] = []
    for row in table_rows(runs, workload):
        level, key = row["concurrency"], row["key"]
        here = {t: runs.get((workload, t, level)) for t in ran}
        if key == METRICS[0][1]:  # each level opens with its completed requests
            done = [_completed(r) if r else "not run" for r in here.values()]
            cells.append([level, "completed", *done, *[""] * len(compared)])
            hits = [_hit_rates(r) if r else "not run" for r in here.values()]
            cells.append(["", "prefix-cache hit rate", *hits, *[""] * len(compared)])
        star = key in BURST_AFFECTED
        marks = {t: "*" if star and r and bursty(r.result) else "" for t, r in here.items()}
        out: list[object] = ["", row["metric"]]
        for t, r in here.items():
            fig = row["values"][t]  # None: not counted, though its result may hold a figure
            gone = r is not None and fig is None and value(r.result, key) is not None
            out.append("not run" if r is None else "not meas." if gone else fmt_num(fig) + marks[t])
        out += [fmt_ratio(row["ratios"][t]) + (marks[t] or marks.get(ref, "")) for t in compared]
        cells.append(out)
    lines = [markdown_table(headers, cells)]
    lines += [f"- {r.name}: {c.text}" for r in mine if (c := check(r)) is not None]
    bursts = [f"{r.name} {d.tokens_per_delivery:.2f} tokens per delivery"
              for r in mine if bursty(r.result) and (d := delivery(r.result))]  # fmt: skip
    if bursts:
        lines.append(
            "- `*`: these streams reached the client in bursts (a process short of CPU), so their "
            "TTFT includes decode steps and TPOT/ITL understate; E2E and throughput are right: "
            + "; ".join(bursts)
        )
    normal = [r.name for (_w, t, _lv), r in sorted(runs.items())
              if t == "pd" and first_token_check(r).measured]  # fmt: skip
    if normal:
        lines.append("- WARNING: the P/D proxy continued requests from prefill's token 1 "
                     f"({', '.join(normal)}): its P/D column is not the normal mode")  # fmt: skip
    return "\n".join(lines)


def breakdown(run: Run) -> list[dict[str, Any]]:
    """Rows of mean ms (exact: sum/count), the p50 bucket and n; derived rows subtract means."""
    lease = (run.gauges.get("prefill") or {}).get(KV_LEASE_SECONDS)
    keys = {"mean_ms": "mean_ttft_ms", "p50_ms": "median_ttft_ms", "count": "completed"}
    client = {k: value(run.result, key) for k, key in keys.items()}
    rows: list[dict[str, Any]] = [{"label": "client TTFT (vllm bench serve)", **client}]
    means: dict[str, float | None] = {}
    for label, source, name in BREAKDOWN:
        hist = (run.deltas.get(source) or {}).get(name)
        if name == PREFILL_HOLD and lease is not None:
            label = f"{label} (lease {lease:g} s)"
        mean, bucket = (None, None) if hist is None else (hist.mean, hist.bucket_of(0.5))
        means[name] = None if mean is None else mean * 1000.0
        p50 = None if bucket is None else [b * 1000.0 for b in bucket]
        count = None if hist is None else hist.count
        rows.append({"label": label, "mean_ms": means[name], "p50_bucket_ms": p50, "count": count})
    derived = {
        "derived: decode TTFB outside the handover": (
            "pd_proxy_decode_ttfb_seconds", HANDOVER_ALL),
        "derived: proxy client TTFB - vLLM TTFT": (
            "pd_proxy_time_to_first_byte_seconds", TTFT_SECONDS),
    }  # fmt: skip
    for label, (a, b) in derived.items():
        x, y = means.get(a), means.get(b)
        rows.append({"label": label, "mean_ms": None if x is None or y is None else x - y})
    return rows


def format_breakdown(runs: Sequence[Run]) -> str:
    """The runs' breakdowns side by side: mean ms and n per target."""
    per = [breakdown(r) for r in runs]
    headers = ["row"] + [f"{TARGET_TITLES[r.target]} {h}" for r in runs for h in ("mean ms", "n")]
    cells = []
    for index, row in enumerate(per[0]):
        line: list[object] = [row["label"]]
        for rows in per:
            count = rows[index].get("count")
            line += [fmt_num(rows[index]["mean_ms"]), "" if count is None else f"{count:.0f}"]
        cells.append(line)
    return markdown_table(headers, cells)


def goals(runs: Runs) -> list[dict[str, Any]]:
    """Each goal of GOALS met, not met, or why not measured. Reported only: never a failure."""
    out: list[dict[str, Any]] = []
    for workload, target, level, low, high in GOALS:
        ref = WORKLOADS[workload][0]
        limit = f"{low:g}-{high:g}x" if low is not None else f"<= {high:g}x"
        pair = f"{TARGET_TITLES[target]}/{TARGET_TITLES[ref]}"
        text = f"{WORKLOAD_NAMES[workload]}: TTFT median {pair} {limit}, c={level}"
        mine, base = runs.get((workload, target, level)), runs.get((workload, ref, level))
        found = None if mine is None else check(mine)
        why = (
            "not run" if mine is None or base is None
            else found.text if found is not None and not found.measured else None
        )  # fmt: skip
        a, b = (value(counted(r), "median_ttft_ms") for r in (mine, base))
        measured, met, r = tables.versus(a, b, high, low, why)
        out.append({"goal": text, "measured": measured, "ratio": r, "met": met})
    return out


def render(
    plan: BenchPlan, short: ShortPlan, runs: Sequence[Run], errors: Sequence[str] = ()
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """The printed text, result.json's content and the summary's figures."""
    by = {(r.workload, r.target, r.level): r for r in runs}
    focus = plan.focus_level()
    titles = {
        MAIN: f"{plan.input_len} in / {plan.output_len} out tokens",
        SHORT: f"short prompts, {short.input_len} in / {short.output_len} out, c=1",
        LONG: f"long prompts, {plan.input_len} in / {short.output_len} out, c=1",
    }
    text = [
        f"vllm bench serve, random dataset, seed {plan.seed} + the level (new prompts at each "
        f"level), temperature {plan.temperature:g}; "
        "single = one vLLM, P/D = prefill + decode through pd-proxy, 1st-tok = through a pd-proxy "
        "with --first-token-from-prefill, +local = through one with --local-prefill-max-tokens N"
    ]
    tables = {}
    for workload in WORKLOADS:
        if any(w == workload for w, _t, _lv in by):
            text += ["", f"== {titles[workload]} ==", format_table(by, workload)]
            tables[WORKLOAD_NAMES[workload]] = table_rows(by, workload)
    where = {
        "main": [r for (w, _t, lv), r in sorted(by.items()) if w == MAIN and lv == focus],
        "short": [r for (w, _t, _lv), r in sorted(by.items()) if w == SHORT],
    }
    where = {name: chosen for name, chosen in where.items() if chosen}
    for name, chosen in where.items():
        title = f"== where TTFT goes, {name} workload, c={chosen[0].level} (means) =="
        text += ["", title, format_breakdown(chosen)]
    found = goals(by)
    ran = [g for g in found if g["measured"] != "not run"]
    rows = [[g["goal"], g["measured"], VERDICT[g["met"]]] for g in ran]
    head = ["goal (reported, never a failure)", "measured", "result"]
    text += ["", "== goals ==", markdown_table(head, rows) if rows else "none measured"]
    text += [f"{len(found) - len(ran)} more not run (in result.json)"] if ran != found else []
    if errors:
        text += ["", "errors (their cells read n/a):", *(f"- {e}" for e in errors)]
    checks = [{"run": r.name, **asdict(c)} for r in runs if (c := check(r)) is not None]
    shown = {name: {r.target: breakdown(r) for r in chosen} for name, chosen in where.items()}
    hits = {r.name: r.hit_rates() for r in runs}
    figures = {"plan": plan.as_dict(), "short_plan": short.as_dict(), "tables": tables,
               "prefix_cache_hit_rate": hits, "checks": checks, "breakdown": shown,
               "goals": found, "errors": list(errors)}  # fmt: skip
    every = [{"workload": WORKLOAD_NAMES[r.workload], "target": r.target, "concurrency": r.level,
              "rows": breakdown(r)} for r in runs]  # fmt: skip
    result = {**figures, "breakdown_every_level": every, "runs": [r.summary() for r in runs]}
    return "\n".join(text), result, figures
