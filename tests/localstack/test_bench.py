"""`pcp-pd-kit bench`: the pure parts, the CLI's early errors, remote mode against a
fake proxy (vLLM's real bench client), and the whole thing end to end on the real CPU stack."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from pcp_pd_kit import repo_root
from pcp_pd_kit.bench import manifest, spec, tables
from pcp_pd_kit.bench.histograms import (
    Histogram,
    counter_delta,
    counter_values,
    delta,
    gauge_max,
    histogram,
    parse_selector,
    selector,
)
from pcp_pd_kit.bench.runner import BenchError, render, resolve_api_key
from pcp_pd_kit.cli import main
from pcp_pd_kit.localstack.report import parse_metrics
from tests.support import procs
from tests.support.bench_results import bench_result
from tests.support.env import example_settings
from tests.support.net import busy_port, closed_port_url

# --- spec: levels, prompts, ports, the vllm bench serve command line --------------------------


def md_cells(line: str) -> list[str]:
    """The cells of one Markdown table row (a sub-row's leading dot dropped)."""
    return [c.strip().removeprefix("· ") for c in line.strip().strip("|").split("|")]


def test_levels_and_prompts_parse_and_reject() -> None:
    assert spec.parse_levels("1, 4,16") == (1, 4, 16)
    assert spec.parse_prompts(None, (1, 4, 16)) == tuple(
        spec.default_prompts(level) for level in (1, 4, 16)
    )
    assert spec.parse_prompts("5", (1, 2)) == (5, 5)
    assert spec.parse_prompts("5,7", (1, 2)) == (5, 7)
    for bad in ("", "0,4", "1,x", "4,4"):
        with pytest.raises(spec.BenchSpecError):
            spec.parse_levels(bad)
    for bad in ("1,2,3", "0", "a"):
        with pytest.raises(spec.BenchSpecError):
            spec.parse_prompts(bad, (1, 2))


def test_default_prompts_grow_with_concurrency() -> None:
    assert spec.default_prompts(1) == spec.MIN_PROMPTS
    assert spec.default_prompts(64) == 64 * spec.PROMPTS_PER_SLOT


def test_bench_ports_are_distinct_and_bounded() -> None:
    ports = spec.bench_ports(18400)
    assert len(set(ports.values())) == len(ports)
    assert ports["proxy_port"] == 18400 and ports["reference_port"] == 18430
    with pytest.raises(spec.BenchSpecError):
        spec.bench_ports(65500)


def test_focus_level_is_the_nearest_level_run() -> None:
    assert spec.BenchPlan().focus_level() == 4
    plan = spec.BenchPlan(levels=(1, 2), prompts=(4, 4), breakdown_level=4)
    assert plan.focus_level() == 2
    with pytest.raises(spec.BenchSpecError):
        spec.BenchPlan(levels=(1, 2), prompts=(4,))


def _opt(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


TARGET = spec.Target("pd", "http://127.0.0.1:18400/", "tiny-llama", "/models/tiny")


def test_bench_serve_argv_fixes_dataset_lengths_seed_and_result() -> None:
    plan = spec.BenchPlan(levels=(1, 4), prompts=(8, 16), input_len=100, output_len=20, seed=7)
    argv = spec.bench_serve_argv(TARGET, plan, 4, "/tmp/out", python="py")
    assert argv[:3] == ["py", "-m", "pcp_pd_kit.bench.vllm_serve"]
    assert _opt(argv, "--base-url") == "http://127.0.0.1:18400"
    assert _opt(argv, "--dataset-name") == "random"
    assert _opt(argv, "--random-input-len") == "100"
    assert _opt(argv, "--random-output-len") == "20"
    assert _opt(argv, "--random-range-ratio") == "0"
    assert _opt(argv, "--seed") == "7"
    assert _opt(argv, "--num-prompts") == "16"
    assert _opt(argv, "--max-concurrency") == "4"
    assert _opt(argv, "--served-model-name") == "tiny-llama"
    assert _opt(argv, "--tokenizer") == "/models/tiny"
    assert _opt(argv, "--result-dir") == "/tmp/out"
    assert _opt(argv, "--result-filename") == "pd-c4.json"
    assert "e2el" in _opt(argv, "--percentile-metrics").split(",")
    assert {"--save-result", "--save-detailed", "--ignore-eos", "--disable-tqdm"} <= set(argv)


@pytest.mark.vllm
def test_bench_serve_argv_parses_with_vllms_own_parser() -> None:
    """The argv means to vLLM's `vllm bench serve` what we think it means."""
    pytest.importorskip("vllm.benchmarks.serve")
    from pcp_pd_kit.bench.vllm_serve import build_parser

    plan = spec.BenchPlan(levels=(2,), prompts=(5,), input_len=33, output_len=9, seed=3)
    args = build_parser().parse_args(spec.bench_serve_argv(TARGET, plan, 2, "/tmp/out")[3:])
    assert (args.dataset_name, args.random_input_len, args.random_output_len) == ("random", 33, 9)
    assert (args.num_prompts, args.max_concurrency, args.seed) == (5, 2, 3)
    assert args.random_range_ratio in ("0", 0, 0.0)
    assert args.save_result and args.save_detailed and args.ignore_eos and args.disable_tqdm
    assert args.temperature == 0.0 and args.backend == "vllm"
    assert args.result_dir == "/tmp/out" and args.result_filename == "pd-c2.json"
    assert args.model == "/models/tiny" and args.served_model_name == "tiny-llama"
    assert args.metadata == ["target=pd", "concurrency=2", "workload=main"]
    assert args.metric_percentiles == "50,99"


# --- tables ----------------------------------------------------------------------------------


def test_ratio_and_value_refuse_what_cannot_be_divided() -> None:
    assert tables.ratio(30.0, 10.0) == pytest.approx(3.0)
    assert tables.ratio(None, 10.0) is None
    assert tables.ratio(3.0, None) is None
    assert tables.ratio(3.0, 0.0) is None
    assert tables.value({"a": float("nan")}, "a") is None
    assert tables.value({"a": True}, "a") is None
    assert tables.value({"a": "12"}, "a") is None
    assert tables.value(None, "a") is None
    assert tables.value({"a": 3}, "a") == 3.0


def test_number_formatting() -> None:
    assert tables.fmt_num(None) == "n/a"
    assert tables.fmt_num(1234.4) == "1234"
    assert tables.fmt_num(12.345) == "12.3"
    assert tables.fmt_num(1.2345) == "1.23"
    assert tables.fmt_ratio(2.0) == "2.00x"
    assert tables.fmt_ratio(None) == "n/a"


def test_table_puts_single_and_pd_side_by_side_with_ratio() -> None:
    results = {
        ("single", 1): bench_result(10.0, 8.0),
        ("pd", 1): bench_result(30.0, 4.0),
        ("single", 4): bench_result(20.0, 20.0),
        ("pd", 4): None,  # the P/D run at 4 produced nothing
    }
    text = tables.format_table(results, (1, 4), (4, 4), title="T")
    lines = text.splitlines()
    assert lines[0] == "T"
    assert lines[2] == "| c | metric | single | P/D | P/D/single |"  # one Markdown printer
    ttft = next(line for line in lines if "TTFT median" in line)
    assert md_cells(ttft)[-3:] == ["10.0", "30.0", "3.00x"]
    rps = next(line for line in lines if "requests/s" in line)
    assert md_cells(rps)[-3:] == ["8.00", "4.00", "0.50x"]
    level4 = lines[lines.index(next(ln for ln in lines if ln.startswith("| 4 |"))) :]
    assert "no result" in level4[0] and "4/4" in level4[0]
    assert all(md_cells(line)[-1] == "n/a" for line in level4[1:8])
    rows = tables.comparison_rows(results, (1, 4))
    assert len(rows) == 2 * len(tables.METRICS)
    assert rows[0]["pd_over_single"] == pytest.approx(3.0)


def test_delivery_counts_bursts_and_merged_tokens() -> None:
    step = 0.004  # a decode step
    burst = 0.00001  # messages read together
    streamed = {"itls": [[step] * 3, [step] * 3], "output_lens": [4, 4]}
    # vLLM merged tokens (4 tokens, 2 messages) / all four messages arrived in one read
    bursty = {"itls": [[step], [burst, burst, burst]], "output_lens": [4, 4]}
    failed = {"itls": [[], [step] * 3], "output_lens": [0, 4]}
    assert tables.delivery(streamed) == tables.Delivery(1.0, 0, 2)
    d = tables.delivery(bursty)
    assert d is not None and d.tokens_per_delivery == pytest.approx(8 / 3)
    assert (d.one_piece, d.requests) == (1, 2)
    assert tables.delivery(failed) == tables.Delivery(1.0, 0, 1)  # the failed one left out
    assert tables.delivery({"median_ttft_ms": 1.0}) is None  # not --save-detailed
    results = {("single", 1): {**bench_result(10, 8), **bursty}, ("pd", 1): streamed}
    warnings = tables.delivery_warnings(results, (1,))
    assert warnings == ["single c=1: 2.67 tokens per delivery, 1/2 requests arrived in one piece"]
    text = tables.format_table(results, (1,), (4,))
    assert "reached the client in bursts" in text
    row = next(ln for ln in text.splitlines() if "tokens per delivery" in ln and "c=" not in ln)
    assert md_cells(row)[-3:] == ["2.67", "1.00", ""]
    ttft = next(ln for ln in text.splitlines() if "TTFT median" in ln)
    assert md_cells(ttft)[-3:] == ["10.0*", "n/a", "n/a*"]  # single's TTFT is suspect
    e2e = next(ln for ln in text.splitlines() if "E2E latency" in ln)
    assert "*" not in e2e


def test_completed_column_names_failures() -> None:
    assert tables.completed_text(bench_result(1, 1, completed=3, failed=1), 4) == "3/4 (1 failed)"
    assert tables.completed_text(None, 4) == "no result"


# --- histograms --------------------------------------------------------------------------------

TTFT_BEFORE = """
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.01",model_name="m"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 2.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 2.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.05
"""
TTFT_AFTER = """
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.01",model_name="m"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 6.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 6.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 2.25
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.01",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.1",model_name="m"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf",model_name="m"} 2.0
vllm:time_to_first_token_seconds_count{engine="1",model_name="m"} 2.0
vllm:time_to_first_token_seconds_sum{engine="1",model_name="m"} 0.1
"""
NAME = "vllm:time_to_first_token_seconds"


def test_histogram_delta_sums_label_sets_and_gives_mean_and_buckets() -> None:
    before = histogram(parse_metrics(TTFT_BEFORE), NAME)
    after = histogram(parse_metrics(TTFT_AFTER), NAME)
    assert after is not None and after.count == 8
    d = delta(after, before)
    assert d is not None
    # engine 0 added 2 in (0.01, 0.1] and 2 above 0.1; engine 1 added 2 in (0.01, 0.1]
    assert d.count == 6 and d.sum == pytest.approx(2.3)
    assert d.buckets == ((0.01, 0.0), (0.1, 4.0), (math.inf, 6.0))
    assert d.mean == pytest.approx(2.3 / 6)
    assert d.bucket_of(0.5) == (0.01, 0.1)
    assert d.quantile(0.5) == pytest.approx(0.01 + 0.09 * 3 / 4)
    assert d.bucket_of(0.99) == (0.1, math.inf)
    assert d.quantile(0.99) == pytest.approx(0.1)  # +Inf bucket: highest finite bound


def test_histogram_absent_restarted_or_empty() -> None:
    assert histogram(parse_metrics(TTFT_BEFORE), "vllm:nope") is None
    before = histogram(parse_metrics(TTFT_BEFORE), NAME)
    assert delta(None, before) is None
    assert delta(before, None) == before  # created during the run: everything is new
    after = histogram(parse_metrics(TTFT_AFTER), NAME)
    assert delta(before, after) is None  # count went down: a restarted server
    empty = Histogram(((math.inf, 0.0),), 0.0, 0.0)
    assert empty.mean is None and empty.quantile(0.5) is None and empty.bucket_of(0.5) is None


# --- breakdown ---------------------------------------------------------------------------------


def _h(mean_s: float, count: int = 4, bound: float = 1.0) -> Histogram:
    return Histogram(((bound, float(count)), (math.inf, float(count))), mean_s * count, count)


def test_breakdown_derives_proxy_overhead_and_pd_vs_single() -> None:
    deltas: dict[str, dict[str, Histogram | None]] = {
        "proxy": {
            "pd_proxy_request_duration_seconds": _h(0.5),
            "pd_proxy_prefill_duration_seconds": _h(0.020),
            "pd_proxy_decode_ttfb_seconds": _h(0.030),
        },
        "prefill": {
            "vllm:e2e_request_latency_seconds": _h(0.015, bound=0.3),
            "vllm:request_queue_time_seconds": _h(0.001, bound=0.3),
        },
        "decode": {
            "vllm:time_to_first_token_seconds": _h(0.025, bound=0.04),
            "vllm:nixl_xfer_time_seconds": None,  # not exported
        },
        "single": {"vllm:time_to_first_token_seconds": _h(0.010, bound=0.02)},
    }
    pd = {"mean_ttft_ms": 60.0, "median_ttft_ms": 55.0, "completed": 4}
    single = {"mean_ttft_ms": 12.0, "median_ttft_ms": 11.0, "completed": 4}
    rows = {r.label.strip(): r for r in tables.breakdown_rows(deltas, pd, single)}
    assert rows["proxy own time before 1st byte"].mean_ms == pytest.approx(60 - 20 - 30)
    assert rows["prefill leg outside prefill vLLM"].mean_ms == pytest.approx(5.0)
    assert rows["decode TTFB outside decode vLLM"].mean_ms == pytest.approx(5.0)
    overhead = rows["P/D TTFT overhead vs single"]
    assert (overhead.mean_ms, overhead.p50_ms) == (pytest.approx(48.0), pytest.approx(44.0))
    assert rows["decode vLLM: TTFT"].p50_bucket_ms == (0.0, 40.0)
    assert rows["decode vLLM: TTFT"].count == 4
    assert rows["decode NIXL transfer (per xfer)"].mean_ms is None
    text = tables.format_breakdown(4, list(rows.values()))
    assert "0.00-40.0" in text and "n/a" in text and "sum/count" in text


def test_breakdown_without_any_metrics_is_all_na_not_an_error() -> None:
    rows = tables.breakdown_rows({}, None, None)
    assert all(r.mean_ms is None for r in rows)
    assert "n/a" in tables.format_breakdown(4, rows)


def test_render_writes_errors_and_focus_breakdown() -> None:
    plan = spec.BenchPlan(levels=(1, 2), prompts=(4, 4), breakdown_level=2)
    from pcp_pd_kit.bench.runner import RunRecord

    records = [
        RunRecord("single", 1, 4, 0, result=bench_result(10, 8)),
        RunRecord("pd", 2, 4, 0, result=bench_result(30, 4)),
    ]
    text, summary = render(plan, records, ["P/D: decode exited"])
    assert "concurrency 2" in text and "P/D: decode exited" in text
    assert summary["errors"] == ["P/D: decode exited"]
    assert [b["concurrency"] for b in summary["breakdown"]] == [1, 2]
    json.dumps(summary)  # JSON-ready


# --- the handover breakdown, the P/D modes, the goals (issue 19) -------------------------------

PHASES = ("admitted_to_read_posted", "read_posted_to_transfer_done", "transfer_done_to_scheduler")
HANDOVER_PAGE = """
# TYPE vllm:nixl_handover_seconds histogram
vllm:nixl_handover_seconds_bucket{engine="0",le="0.005",phase="admitted_to_read_posted"} 3.0
vllm:nixl_handover_seconds_bucket{engine="0",le="0.05",phase="admitted_to_read_posted"} 4.0
vllm:nixl_handover_seconds_bucket{engine="0",le="+Inf",phase="admitted_to_read_posted"} 4.0
vllm:nixl_handover_seconds_count{engine="0",phase="admitted_to_read_posted"} 4.0
vllm:nixl_handover_seconds_sum{engine="0",phase="admitted_to_read_posted"} 0.02
vllm:nixl_handover_seconds_bucket{engine="0",le="0.005",phase="prefill_kv_hold"} 0.0
vllm:nixl_handover_seconds_bucket{engine="0",le="0.05",phase="prefill_kv_hold"} 0.0
vllm:nixl_handover_seconds_bucket{engine="0",le="+Inf",phase="prefill_kv_hold"} 0.0
vllm:nixl_handover_seconds_count{engine="0",phase="prefill_kv_hold"} 0.0
vllm:nixl_handover_seconds_sum{engine="0",phase="prefill_kv_hold"} 0.0
# TYPE pd_proxy_first_token_requests_total counter
pd_proxy_first_token_requests_total{outcome="continued",reason=""} 7.0
pd_proxy_first_token_requests_total{outcome="normal",reason="logprobs"} 2.0
pd_proxy_first_token_requests_total{outcome="normal",reason="echo"} 1.0
# TYPE vllm:nixl_kv_lease_seconds gauge
vllm:nixl_kv_lease_seconds{engine="0"} 30.0
vllm:nixl_kv_lease_seconds{engine="1"} 45.0
"""


def test_selector_reads_one_label_set_of_a_histogram() -> None:
    key = selector("vllm:nixl_handover_seconds", {"phase": "admitted_to_read_posted"})
    assert key == 'vllm:nixl_handover_seconds{phase="admitted_to_read_posted"}'
    assert parse_selector(key) == ("vllm:nixl_handover_seconds", {"phase": PHASES[0]})
    assert parse_selector("x") == ("x", {}) and selector("x") == "x"
    samples = parse_metrics(HANDOVER_PAGE)
    posted = histogram(samples, key)
    assert posted is not None and (posted.count, posted.sum) == (4.0, pytest.approx(0.02))
    assert posted.bucket_of(0.5) == (0.0, 0.005)
    hold = histogram(samples, "vllm:nixl_handover_seconds", {"phase": "prefill_kv_hold"})
    assert hold is not None and hold.count == 0 and hold.mean is None  # exported at 0
    assert histogram(samples, tables.handover_selector("no_such_phase")) is None
    whole = histogram(samples, "vllm:nixl_handover_seconds")
    assert whole is not None and whole.count == 4.0  # every phase summed: what selectors avoid


def test_counters_per_label_set_and_gauges() -> None:
    samples = parse_metrics(HANDOVER_PAGE)
    name = "pd_proxy_first_token_requests_total"
    before = counter_values(samples, name, ("outcome", "reason"))
    assert before == {
        f'{name}{{outcome="continued",reason=""}}': 7.0,
        f'{name}{{outcome="normal",reason="logprobs"}}': 2.0,
        f'{name}{{outcome="normal",reason="echo"}}': 1.0,
    }
    assert counter_values(samples, name, ("outcome",)) == {
        f'{name}{{outcome="continued"}}': 7.0,
        f'{name}{{outcome="normal"}}': 3.0,
    }
    assert counter_values(samples, "pd_proxy_nope_total") is None
    after = {**before, f'{name}{{outcome="continued",reason=""}}': 11.0}
    after[f'{name}{{outcome="normal",reason="stop"}}'] = 1.0  # new label set: counts from 0
    after[f'{name}{{outcome="normal",reason="echo"}}'] = 0.5  # went down: a restart
    grown = counter_delta(after, before)
    assert grown is not None
    assert grown[f'{name}{{outcome="continued",reason=""}}'] == 4.0
    assert grown[f'{name}{{outcome="normal",reason="stop"}}'] == 1.0
    assert grown[f'{name}{{outcome="normal",reason="echo"}}'] == 0.5
    assert counter_delta(None, before) is None
    assert gauge_max(samples, "vllm:nixl_kv_lease_seconds") == 45.0
    assert gauge_max(samples, "vllm:nope") is None


def test_handover_rows_follow_the_connectors_phases() -> None:
    from pcp_nixl_connector.handover import DECODE_PHASES, PHASES
    from pcp_nixl_connector.metric_names import HANDOVER_SECONDS

    assert tuple(tables.HANDOVER_PHASE_LABELS) == DECODE_PHASES
    assert tables.PREFILL_HOLD in PHASES and tables.OVERALL_PHASE in DECODE_PHASES
    wanted = tables.breakdown_metrics()
    for phase in DECODE_PHASES:
        assert f'{HANDOVER_SECONDS}{{phase="{phase}"}}' in wanted["decode"]
    assert f'{HANDOVER_SECONDS}{{phase="prefill_kv_hold"}}' in wanted["prefill"]
    assert "pd_proxy_time_to_first_byte_seconds" in wanted["proxy"]
    assert tables.ITL_SECONDS in wanted["decode"]
    assert len(wanted["proxy"]) == len(set(wanted["proxy"]))  # read once, used twice


class _Pages(BaseHTTPRequestHandler):
    """GET /<source>/metrics -> that fake server's registry (prefill, decode, proxy, ...)."""

    protocol_version = "HTTP/1.0"
    registries: dict[str, Any] = {}

    def do_GET(self) -> None:
        from prometheus_client import generate_latest

        source, _, rest = self.path.strip("/").partition("/")
        registry = self.registries.get(source)
        if rest != "metrics" or registry is None:
            self.send_response(404)
            self.end_headers()
            return
        body = generate_latest(registry)
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


HANDOVER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)


class _FakePd:
    """The metrics of a prefill, a decode and a pd-proxy, as the kit's servers export them
    (every handover phase exported at 0 on both servers, as the connector does)."""

    def __init__(self, first_token: bool) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge
        from prometheus_client import Histogram as H

        from pcp_nixl_connector.handover import PHASES
        from pcp_nixl_connector.metric_names import HANDOVER_SECONDS, KV_LEASE_SECONDS

        self.registries = {k: CollectorRegistry() for k in ("prefill", "decode", "proxy")}
        self.handover = {}
        for server in ("prefill", "decode"):
            reg = self.registries[server]
            hist = H(
                HANDOVER_SECONDS, "h", ("engine", "phase"), buckets=HANDOVER_BUCKETS, registry=reg
            )
            self.handover[server] = {p: hist.labels("0", p) for p in PHASES}
            Gauge(KV_LEASE_SECONDS, "l", ("engine",), registry=reg).labels("0").set(30)
        dec = self.registries["decode"]
        self.xfer = H("vllm:nixl_xfer_time_seconds", "x", registry=dec, buckets=HANDOVER_BUCKETS)
        self.itl = H(
            "vllm:inter_token_latency_seconds", "i", registry=dec, buckets=HANDOVER_BUCKETS
        )
        proxy = self.registries["proxy"]
        self.proxy = {
            name: H(name, "p", registry=proxy, buckets=HANDOVER_BUCKETS)
            for name in (
                "pd_proxy_time_to_first_byte_seconds",
                "pd_proxy_prefill_duration_seconds",
                "pd_proxy_decode_ttfb_seconds",
            )
        }
        self.first_token = None
        if first_token:
            self.first_token = Counter(
                "pd_proxy_first_token_requests", "f", ("outcome", "reason"), registry=proxy
            )
            for outcome in ("continued", "finished"):
                self.first_token.labels(outcome, "")

    def serve(self, n: int, steps: tuple[float, ...], outcome: str | None = "continued") -> None:
        """n requests whose four decode handover phases took `steps` seconds."""
        admitted_to_first = sum(steps)
        for _ in range(n):
            for phase, took in zip(tables.HANDOVER_PHASE_LABELS, steps, strict=False):
                self.handover["decode"][phase].observe(took)
            self.handover["decode"][tables.OVERALL_PHASE].observe(admitted_to_first)
            self.handover["prefill"][tables.PREFILL_HOLD].observe(0.18)
            self.xfer.observe(0.002)
            for _ in range(3):
                self.itl.observe(0.004)
            self.proxy["pd_proxy_time_to_first_byte_seconds"].observe(admitted_to_first + 0.03)
            self.proxy["pd_proxy_prefill_duration_seconds"].observe(0.02)
            self.proxy["pd_proxy_decode_ttfb_seconds"].observe(admitted_to_first + 0.008)
            if self.first_token is not None and outcome is not None:
                reason = "logprobs" if outcome == "normal" else ""
                self.first_token.labels(outcome, reason).inc()


@pytest.fixture
def pages() -> Iterator[tuple[str, dict[str, Any]]]:
    registries: dict[str, Any] = {}
    handler = type("Pages", (_Pages,), {"registries": registries})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", registries
    finally:
        server.shutdown()
        server.server_close()


def _measure(
    url: str, registries: dict[str, Any], target: str, level: int, fake: _FakePd, serve: Any
) -> Any:
    """One run as run_target records it: scrape, serve requests, scrape again."""
    from pcp_pd_kit.bench.runner import (
        RunRecord,
        counter_deltas_between,
        deltas_between,
        gauges_after,
        snapshot,
    )

    for source, registry in fake.registries.items():
        registries[f"{target}-{source}"] = registry
    sources = {source: f"{url}/{target}-{source}" for source in fake.registries}
    before = snapshot(sources, None)
    serve()
    after = snapshot(sources, None)
    record = RunRecord(target, level, 4, 0)
    record.deltas = deltas_between(before, after)
    record.counters = counter_deltas_between(before, after)
    record.gauges = gauges_after(after)
    return record


PD_STEPS = (0.002, 0.049, 0.0004, 0.014)  # 65.4 ms admitted -> first token
FT_STEPS = (0.001, 0.004, 0.0004, 0.0036)  # 9 ms


def _pd_records(url: str, registries: dict[str, Any], ft_outcome: str = "continued") -> list[Any]:
    """single, P/D and P/D first token at concurrency 1 and 4, read from fake /metrics."""
    from pcp_pd_kit.bench.runner import RunRecord

    records = []
    for level, (single, pd, ft) in {1: (10.0, 40.0, 11.0), 4: (20.0, 80.0, 29.0)}.items():
        records.append(RunRecord("single", level, 4, 0, result=bench_result(single, 8)))
        fake = _FakePd(first_token=False)
        warm = _FakePd(first_token=True)
        warm.serve(2, (0.5,))  # warm-up requests before the first scrape: not counted
        record = _measure(url, registries, "pd", level, fake, lambda f=fake: f.serve(4, PD_STEPS))
        record.result = bench_result(pd, 4)
        records.append(record)
        record = _measure(
            url, registries, "pd-ft", level, warm, lambda f=warm: f.serve(4, FT_STEPS, ft_outcome)
        )
        record.result = bench_result(ft, 4)
        records.append(record)
    return records


def test_render_reads_the_handover_from_metrics_and_checks_the_goals(
    pages: tuple[str, dict[str, Any]],
) -> None:
    url, registries = pages
    records = _pd_records(url, registries)
    plan = spec.BenchPlan(levels=(1, 4), prompts=(4, 4), breakdown_level=4)
    text, summary = render(plan, records)
    json.dumps(summary)
    lines = text.splitlines()
    # the P/D modes side by side, with both ratios and the first-token proxy's outcomes
    modes = lines[lines.index(next(ln for ln in lines if ln.startswith("== TTFT and E2E"))) :]
    ttft1 = next(ln for ln in modes if "TTFT median" in ln)
    assert md_cells(ttft1)[-5:] == ["10.0", "40.0", "11.0", "4.00x", "1.10x"]
    assert "first-token proxy: 4/4 continued from token 1" in text
    assert "NOT MEASURED" not in text
    assert summary["first_token"]["4"]["measured"] is True
    assert summary["first_token"]["4"]["continued"] == 4  # the warm-up's 2 not counted
    row = next(
        r for r in summary["modes"] if r["concurrency"] == 4 and r["key"] == "median_e2el_ms"
    )
    assert (row["single"], row["pd"], row["pd_ft"]) == (120.0, 180.0, 129.0)
    assert row["pd_ft_over_single"] == pytest.approx(129 / 120)
    # the handover, per phase and mode, with n and the lease
    assert "P/D handover per request, by phase, concurrency 4" in text
    start = lines.index(next(ln for ln in lines if ln.startswith("== P/D handover")))
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("decode phases:"))
    rows = [md_cells(ln) for ln in lines[start + 4 : end] if ln.startswith("|")]
    table = {cells[0]: [c for c in cells[1:] if c] for cells in rows}
    overall = table["decode: admitted -> first token (all)"]
    assert overall == ["65.4", "50.0-75.0", "4", "9.00", "5.00-10.0", "4"]
    assert table["decode: admitted -> read posted"][:3] == ["2.00", "1.00-2.50", "4"]
    assert table["prefill: KV hold, done -> freed (lease 30 s)"][:3] == ["180", "100-250", "4"]
    assert table["decode step (vLLM inter-token latency)"][:3] == ["4.00", "2.50-5.00", "12"]
    assert table["decode TTFB outside the handover"] == ["8.00", "8.00"]
    assert table["proxy: client TTFB (received -> 1st byte)"][0] == "95.4"
    focus = next(h for h in summary["handover"] if h["concurrency"] == 4)
    ft_rows = {r["label"]: r for r in focus["modes"]["pd-ft"]}
    assert ft_rows["decode: transfer done -> scheduler"]["count"] == 4
    assert ft_rows["decode: transfer done -> scheduler"]["mean_ms"] == pytest.approx(0.4)
    assert ft_rows["decode: scheduler -> first token"]["p50_estimate_ms"] is not None
    # the goals: reported per mode and level, met or not
    goals = {(g["goal"], g["mode"]): g for g in summary["goals"]}
    assert goals[("TTFT median <= 1.2x single, c=1", "pd")]["met"] is False
    assert goals[("TTFT median <= 1.2x single, c=1", "pd-ft")]["met"] is True  # 1.10x
    assert goals[("TTFT median <= 1.5x single, c=4", "pd-ft")]["met"] is True  # 1.45x
    handover = goals[("handover <= xfer + step + 5 ms, c=4", "pd")]
    assert handover["met"] is False
    assert handover["value"] == pytest.approx(65.4)
    assert handover["limit"] == pytest.approx(2.0 + 4.0 + 5.0)
    assert goals[("handover <= xfer + step + 5 ms, c=4", "pd-ft")]["met"] is True  # 9 <= 11
    assert "65.4 vs 2.00 + 4.00 + 5 = 11.0 ms" in text
    assert "NOT MET" in text and " met" in text and "never a failure" in text


def test_a_first_token_mode_that_fell_back_is_not_measured(
    pages: tuple[str, dict[str, Any]],
) -> None:
    url, registries = pages
    records = _pd_records(url, registries, ft_outcome="normal")
    plan = spec.BenchPlan(levels=(1, 4), prompts=(4, 4))
    text, summary = render(plan, records)
    assert "NOT MEASURED: 0/4 continued from token 1, 4 normal flow (logprobs 4)" in text
    assert summary["first_token"]["1"]["measured"] is False
    ttft = next(ln for ln in text.splitlines() if "TTFT median" in ln and "not meas." in ln)
    assert md_cells(ttft)[-2:] == ["4.00x", "n/a"]
    assert all(r["pd_ft"] is None for r in summary["modes"])
    ft_goals = [g for g in summary["goals"] if g["mode"] == "pd-ft"]
    assert ft_goals and all(g["met"] is None for g in ft_goals)
    assert all(g["measured"] == "not measured: nothing continued" for g in ft_goals)
    assert any(g["met"] is False for g in summary["goals"] if g["mode"] == "pd")


def test_first_token_check_needs_the_proxys_counter() -> None:
    unread = tables.first_token_check({}, {"completed": 4})
    assert not unread.measured and unread.continued is None and unread.completed == 4
    assert unread.text().startswith("NOT MEASURED: no pd_proxy_first_token_requests_total")
    name = "pd_proxy_first_token_requests_total"
    mixed = tables.first_token_check(
        {
            "proxy": {
                f'{name}{{outcome="continued",reason=""}}': 3.0,
                f'{name}{{outcome="finished",reason=""}}': 1.0,
                f'{name}{{outcome="normal",reason="echo"}}': 0.0,
            }
        },
        None,
    )
    assert mixed.measured and mixed.normal == {}
    assert mixed.text() == "3/4 continued from token 1, 1 ended by token 1"


def test_goals_not_run_are_reported_not_guessed() -> None:
    results = {("pd", 2): bench_result(30.0, 4), ("single", 2): bench_result(10.0, 8)}
    found = tables.goals(results, {}, {})
    assert found and all(g.met is None and g.measured.endswith("not run") for g in found)
    assert "c=1 not run" in tables.format_goals(found)
    # c=1 run without the single instance, and without handover metrics
    results = {("pd", 1): bench_result(30.0, 4)}
    by_goal = {(g.goal, g.mode): g for g in tables.goals(results, {("pd", 1): {}}, {})}
    assert by_goal[("TTFT median <= 1.2x single, c=1", "pd")].measured == "single not run"
    handover = by_goal[("handover <= xfer + step + 5 ms, c=1", "pd")]
    assert handover.met is None and "no handover, NIXL transfer, ITL" in handover.measured


def test_render_warns_when_the_pd_proxy_itself_runs_first_token_mode() -> None:
    from pcp_pd_kit.bench.runner import RunRecord

    name = "pd_proxy_first_token_requests_total"
    record = RunRecord("pd", 1, 4, 0, result=bench_result(30.0, 4))
    record.counters = {"proxy": {f'{name}{{outcome="continued",reason=""}}': 4.0}}
    text, _ = render(spec.BenchPlan(levels=(1,), prompts=(4,)), [record])
    assert "it runs --first-token-from-prefill" in text


# --- the first-token pd-proxy in the local stack -----------------------------------------------


def test_first_token_proxy_is_a_second_pd_proxy_on_its_own_port(tmp_path: Path) -> None:
    from pcp_pd_kit.localstack import commands
    from pcp_pd_kit.localstack.stack import FIRST_TOKEN_PROXY, PD_PARTS, Stack

    settings = example_settings()
    normal = commands.proxy_spec(settings)
    assert "--first-token-from-prefill" not in normal.argv and normal.name == "proxy"
    ft = commands.proxy_spec(settings, first_token_port=settings.proxy_port + 7)
    assert ft.argv[-1] == "--first-token-from-prefill" and ft.name == "proxy-first-token"
    assert _opt(ft.argv, "--port") == str(settings.proxy_port + 7)
    assert ft.health_url == f"{settings.url(settings.proxy_port + 7)}/health"
    assert ft.argv[:-1] == [
        str(settings.proxy_port + 7) if a == str(settings.proxy_port) else a for a in normal.argv
    ]
    # default parts (make up / make demo) unchanged; the part is opt-in
    assert FIRST_TOKEN_PROXY not in PD_PARTS
    plain = Stack(settings, work_dir=tmp_path)
    assert FIRST_TOKEN_PROXY not in plain.urls and FIRST_TOKEN_PROXY not in plain._ports()
    parts = ("prefill", "decode", "proxy", FIRST_TOKEN_PROXY)
    stack = Stack(settings, parts=parts, work_dir=tmp_path, first_token_proxy_port=18999)
    assert stack.urls[FIRST_TOKEN_PROXY] == settings.url(18999)
    assert stack._ports()[FIRST_TOKEN_PROXY] == 18999
    assert Stack(settings, parts=parts, work_dir=tmp_path).first_token_proxy_port == (
        settings.proxy_port + 1
    )


def test_bench_phases_start_a_first_token_proxy_only_when_asked() -> None:
    from pcp_pd_kit.bench.runner import _phase_parts, parse_targets
    from pcp_pd_kit.localstack.stack import FIRST_TOKEN_PROXY, LOCAL_PREFILL_PROXY

    assert parse_targets("single,pd,pd-local,pd-ft") == spec.TARGETS
    with pytest.raises(BenchError, match="single,pd,pd-local,pd-ft"):
        parse_targets("pd,nope")
    assert _phase_parts("pd", spec.TARGETS) == (
        "prefill",
        "decode",
        "proxy",
        LOCAL_PREFILL_PROXY,
        FIRST_TOKEN_PROXY,
    )
    assert _phase_parts("pd", ("single", "pd", "pd-ft")) == (
        "prefill",
        "decode",
        "proxy",
        FIRST_TOKEN_PROXY,
    )
    assert _phase_parts("pd", ("single", "pd")) == ("prefill", "decode", "proxy")
    assert _phase_parts("pd", ("pd-ft",)) == ("prefill", "decode", FIRST_TOKEN_PROXY)
    assert spec.first_token_proxy_port(18400) == 18401
    assert spec.first_token_proxy_port(18400) not in spec.bench_ports(18400).values()


@pytest.mark.parametrize(
    ("offset", "part"),
    [
        (spec.FIRST_TOKEN_PROXY_OFFSET, "proxy-first-token"),
        (spec.LOCAL_PREFILL_PROXY_OFFSET, "proxy-local-prefill"),
    ],
)
def test_cli_busy_extra_proxy_port_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], offset: int, part: str
) -> None:
    with busy_port() as busy:
        base = busy - offset
        code = main(["bench", "serve", "--port-base", str(base), "--results-dir", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert f"{part} port {busy}" in err and "already in use" in err
    assert list(tmp_path.iterdir()) == []


# --- manifest ----------------------------------------------------------------------------------

CPUINFO = """processor\t: 0
model name\t: AMD EPYC 9B14
physical id\t: 0
core id\t\t: 0

processor\t: 1
model name\t: AMD EPYC 9B14
physical id\t: 0
core id\t\t: 0

processor\t: 2
model name\t: AMD EPYC 9B14
physical id\t: 0
core id\t\t: 1
"""


def test_cpuinfo_counts_logical_cpus_and_physical_cores() -> None:
    info = manifest.parse_cpuinfo(CPUINFO)
    assert info == {"cpu_model": "AMD EPYC 9B14", "logical_cpus": 3, "physical_cores": 2}
    assert manifest.parse_cpuinfo("") == {
        "cpu_model": None,
        "logical_cpus": None,
        "physical_cores": None,
    }


def test_argv_redaction_hides_the_key_in_both_spellings() -> None:
    argv = ["x", "--api-key", "sk-1", "--api-key=sk-2", "--base-url", "u"]
    out = manifest.redact_argv(argv)
    assert "sk-1" not in out and "sk-2" not in " ".join(out)
    assert out[-2:] == ["--base-url", "u"]


def test_manifest_has_versions_topology_knobs_and_no_secret() -> None:
    plan = spec.BenchPlan()
    settings = example_settings()
    data = manifest.build_manifest(
        plan=plan,
        mode="local",
        targets={"pd": "http://x"},
        topology=manifest.local_topology(settings),
        settings=settings,
        argv=["py", "bench", "--api-key", "sk-secret"],
        started_utc=manifest.utc_stamp(),
        git={"commit": "abc", "dirty": False},
        host={"cpu_model": "c"},
        versions=manifest.package_versions({"vllm": ("not-a-dist-xyz",), "pytest": ("pytest",)}),
    )
    text = json.dumps(data)
    assert "sk-secret" not in text
    assert data["versions"]["vllm"] is None and data["versions"]["pytest"].endswith("(pytest)")
    assert data["settings"]["decode_cpus"] == settings.decode_cpus
    assert data["topology"]["pd"]["kv_connector"] == settings.kv_connector
    assert data["bench"]["prompts"] == {str(n): spec.default_prompts(n) for n in plan.levels}
    assert data["bench"]["dataset"] == "random" and data["bench"]["seed"] == plan.seed
    assert re.fullmatch(r"\d{8}T\d{6}Z", data["started_utc"])


def test_api_key_precedence(tmp_path: Path) -> None:
    import argparse

    key_file = tmp_path / "keys"
    key_file.write_text("# comment\n\nsk-from-file\nsk-second\n")
    ns = argparse.Namespace
    env = {"OPENAI_API_KEY": "sk-env"}
    assert resolve_api_key(ns(api_key="sk-arg", api_key_file=str(key_file)), env) == "sk-arg"
    assert resolve_api_key(ns(api_key=None, api_key_file=str(key_file)), env) == "sk-from-file"
    assert resolve_api_key(ns(api_key=None, api_key_file=None), env) == "sk-env"
    assert resolve_api_key(ns(api_key=None, api_key_file=None), {}) is None
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(BenchError, match="no key"):
        resolve_api_key(ns(api_key=None, api_key_file=str(tmp_path / "empty")), {})


# --- the CLI fails early, before starting or writing anything ----------------------------------


def test_cli_bad_concurrency_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "serve", "--concurrency", "0", "--results-dir", str(tmp_path)]) == 2
    assert "--concurrency" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_cli_unreachable_deployment_starts_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = closed_port_url()
    assert main(["bench", "serve", "--base-url", url, "--results-dir", str(tmp_path)]) == 2
    assert "no answer" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_cli_busy_bench_port_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with busy_port() as busy:
        base = busy - spec.PORT_OFFSETS["reference_port"]
        if base < 1:
            pytest.skip("ephemeral port too low for a base")
        code = main(["bench", "serve", "--port-base", str(base), "--results-dir", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert f"reference port {busy}" in err and "already in use" in err
    assert list(tmp_path.iterdir()) == []


# --- remote mode against a fake proxy that wants a key, with vLLM's real bench client ----------

API_KEY = "sk-bench-test-key-0123456789"


class _FakeProxy(BaseHTTPRequestHandler):
    """/v1/models, streaming /v1/completions and pd-proxy's histograms; Bearer key required."""

    protocol_version = "HTTP/1.0"
    model_root = ""
    seen: dict[str, int] = {}
    lock = threading.Lock()
    registry: Any = None
    durations: Any = None
    served: Any = None  # called after each completion: what the servers behind it observe

    def _count(self, key: str) -> None:
        with self.lock:
            self.seen[key] = self.seen.get(key, 0) + 1

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {API_KEY}":
            return True
        self._count(f"unauthorized {self.command} {self.path}")
        self._send(401, b'{"error": {"message": "missing API key"}}')
        return False

    def do_GET(self) -> None:
        if not self._authorized():
            return
        if self.path == "/v1/models":
            body = {"data": [{"id": "fake-model", "root": self.model_root}]}
            self._send(200, json.dumps(body).encode())
        elif self.path == "/metrics":
            from prometheus_client import generate_latest

            self._send(200, generate_latest(self.registry), "text/plain; version=0.0.4")
        else:
            self._send(404, b"{}")

    def do_POST(self) -> None:
        if not self._authorized():
            return
        length = int(self.headers.get("Content-Length", "0"))
        body = json.loads(self.rfile.read(length) or b"{}")
        if self.path != "/v1/completions":
            self._send(404, b"{}")
            return
        start = time.monotonic()
        self._count("completions")
        tokens = int(body.get("max_tokens") or 1)
        if not body.get("stream"):
            self._send(200, json.dumps({"choices": [{"text": "x" * tokens}]}).encode())
            self.durations.observe(time.monotonic() - start)
            if self.served is not None:
                self.served()
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(tokens):
            self.wfile.write(b'data: {"choices": [{"text": "x"}]}\n\n')
            self.wfile.flush()
            time.sleep(0.002)
        usage = {"choices": [], "usage": {"completion_tokens": tokens, "prompt_tokens": 1}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        self.wfile.flush()
        self.durations.observe(time.monotonic() - start)
        if self.served is not None:
            self.served()

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def _fake_proxy_server(
    registry: Any = None, served: Any = None
) -> Iterator[tuple[str, type[_FakeProxy]]]:
    """A fake pd-proxy exporting `registry` (default: a new one) with its request histogram;
    `served()` runs after each completion it answers."""
    from prometheus_client import CollectorRegistry
    from prometheus_client import Histogram as PromHistogram

    from pcp_pd_kit.localstack.model_source import resolve_model

    registry = CollectorRegistry() if registry is None else registry
    handler = type(
        "FakeProxy",
        (_FakeProxy,),
        {
            "model_root": resolve_model("", "", repo_root()).path,  # builds the tiny model
            "seen": {},
            "lock": threading.Lock(),
            "registry": registry,
            "durations": PromHistogram("pd_proxy_request_duration_seconds", "d", registry=registry),
            "served": staticmethod(served) if served is not None else None,
        },
    )
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def fake_proxy() -> Iterator[tuple[str, type[_FakeProxy]]]:
    with _fake_proxy_server() as found:
        yield found


def _remote_bench_args(url: str, key_file: Path, results: Path, concurrency: str) -> list[str]:
    """`bench` against a running proxy: 3 prompts of 16 tokens in, 4 out, at each level."""
    return [
        "bench",
        "serve",
        "--base-url",
        url,
        "--api-key-file",
        str(key_file),
        "--concurrency",
        concurrency,
        "--prompts",
        "3",
        "--input-len",
        "16",
        "--output-len",
        "4",
        "--results-dir",
        str(results),
    ]


def _run_cli(args: list[str], timeout_s: float, capsys: pytest.CaptureFixture[str]) -> tuple:
    """`python -m pcp_pd_kit ...` in its own session, its output echoed to the terminal."""
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pcp_pd_kit", *args],
        cwd=repo_root(),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            with capsys.disabled():
                sys.stderr.write(f"  bench| {line}")

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                pytest.fail(f"bench still running after {timeout_s:.0f}s")
            time.sleep(1)
    finally:
        procs.stop(proc, grace_s=90)  # timeout or Ctrl-C: SIGTERM lets it stop its own stack
        reader.join(timeout=10)
    return proc.returncode, "".join(lines)


def _only_run_dir(results: Path) -> Path:
    dirs = [p for p in results.iterdir() if p.is_dir()]
    assert len(dirs) == 1 and re.fullmatch(r"serve-\d{8}T\d{6}Z", dirs[0].name), dirs
    return dirs[0]


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_remote_mode_sends_the_key_and_starts_nothing(
    tmp_path: Path,
    fake_proxy: tuple[str, type[_FakeProxy]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("vllm.benchmarks.serve")
    url, handler = fake_proxy
    key_file = tmp_path / "api_keys"
    key_file.write_text(f"{API_KEY}\n")
    results = tmp_path / "results"
    code, out = _run_cli(_remote_bench_args(url, key_file, results, "1,2"), 420, capsys)
    assert code == 0, out
    run = _only_run_dir(results)
    # vllm bench serve also GETs /metrics without a key (for speculative-decoding stats): ignored
    assert not [k for k in handler.seen if k.startswith("unauthorized") and "/v1/" in k]
    assert handler.seen["completions"] == 2 + 3 + 3  # warm-up + two levels
    for level in (1, 2):
        result = json.loads((run / f"pd-c{level}.json").read_text())
        assert result["completed"] == 3 and result["failed"] == 0
        assert result["total_output_tokens"] == 3 * 4
        assert not (run / f"single-c{level}.json").exists()
    summary = json.loads((run / "result.json").read_text())
    focus = next(b for b in summary["breakdown"] if b["concurrency"] == 2)
    whole = next(r for r in focus["rows"] if r["label"] == "proxy: whole request")
    assert whole["count"] == 3
    data = json.loads((run / "manifest.json").read_text())
    assert data["mode"] == "remote" and data["settings"] is None
    assert data["topology"]["pd_url"] == url
    for path in run.rglob("*"):
        if path.is_file():
            assert API_KEY not in path.read_text(errors="replace"), path
    assert "TTFT median" in out and "not run" in out  # no single: its column is n/a


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_remote_mode_measures_the_first_token_proxy_and_the_handover(
    tmp_path: Path,
    pages: tuple[str, dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--first-token-url: a second proxy measured beside the first, its outcomes checked; the
    handover read from the prefill's and decode's /metrics (fakes observing per completion)."""
    pytest.importorskip("vllm.benchmarks.serve")
    pages_url, registries = pages
    servers = _FakePd(first_token=True)
    registries.update(prefill=servers.registries["prefill"], decode=servers.registries["decode"])
    key_file = tmp_path / "api_keys"
    key_file.write_text(f"{API_KEY}\n")
    results = tmp_path / "results"
    with (
        _fake_proxy_server(served=lambda: servers.serve(1, PD_STEPS, None)) as (normal, _),
        _fake_proxy_server(servers.registries["proxy"], lambda: servers.serve(1, FT_STEPS)) as (
            first_token,
            _,
        ),
    ):
        args = _remote_bench_args(normal, key_file, results, "1")
        args += ["--first-token-url", first_token]
        args += ["--prefill-metrics-url", f"{pages_url}/prefill"]
        args += ["--decode-metrics-url", f"{pages_url}/decode"]
        code, out = _run_cli(args, 420, capsys)
    assert code == 0, out
    run = _only_run_dir(results)
    for target in ("pd", "pd-ft"):
        assert json.loads((run / f"{target}-c1.json").read_text())["completed"] == 3
    summary = json.loads((run / "result.json").read_text())
    assert summary["first_token"]["1"]["continued"] == 3  # the warm-up's 2 came before
    assert summary["first_token"]["1"]["measured"] is True
    focus = summary["handover"][0]
    for mode, took in (("pd", 65.4), ("pd-ft", 9.0)):
        rows = {r["label"]: r for r in focus["modes"][mode]}
        overall = rows["decode: admitted -> first token (all)"]
        assert overall["count"] == 3 and overall["mean_ms"] == pytest.approx(took)
        assert rows["prefill: KV hold, done -> freed (lease 30 s)"]["count"] == 3
    goals = {(g["goal"], g["mode"]): g for g in summary["goals"]}
    assert goals[("handover <= xfer + step + 5 ms, c=1", "pd")]["met"] is False
    assert goals[("handover <= xfer + step + 5 ms, c=1", "pd-ft")]["met"] is True
    assert goals[("TTFT median <= 1.2x single, c=1", "pd-ft")]["measured"] == "single not run"
    data = json.loads((run / "manifest.json").read_text())
    assert data["topology"]["first_token_url"] == first_token
    assert data["findings"]["first_token"]["1"]["measured"] is True
    assert data["findings"]["handover"]["concurrency"] == 1
    assert "first-token proxy: 3/3 continued from token 1" in out
    assert "P/D handover per request, by phase, concurrency 1" in out


# --- end to end on the real CPU stack ----------------------------------------------------------

SMOKE_PORT_BASE = 18600  # apart from make up (18000s), make bench (18400s), e2e (18500s)


def _leftovers(port_base: int, marker: str) -> list[str]:
    """Processes still holding a bench port or running a bench client for this run."""
    import psutil

    ports = {str(p) for p in spec.bench_ports(port_base).values()}
    ports.add(str(spec.first_token_proxy_port(port_base)))
    ports.add(str(spec.local_prefill_proxy_port(port_base)))
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            cmdline = proc.info["cmdline"] or []
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        joined = " ".join(cmdline)
        port_args = {cmdline[i + 1] for i, a in enumerate(cmdline[:-1]) if a == "--port"}
        if port_args & ports or marker in joined:
            found.append(f"{proc.info['pid']}: {joined[:200]}")
    return found


@pytest.mark.e2e
@pytest.mark.timeout(1800)
def test_bench_end_to_end_on_the_cpu_stack(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Single vLLM, then P/D through pd-proxy, through a second pd-proxy with
    --first-token-from-prefill and through a third with --local-prefill-max-tokens (short prompts
    on single, P/D and decode alone; long ones through it), tiny counts; figures plausible, the
    handover breakdown read from the connector's histograms, the first-token proxy really
    continued requests, the local-prefill proxy took the local path for the short prompts and P/D
    for the long ones, nothing left."""
    pytest.importorskip("vllm")
    results = tmp_path / "results"
    code, out = _run_cli(
        [
            "bench",
            "serve",
            "--concurrency",
            "1,2",
            "--prompts",
            "4",
            "--input-len",
            "40",  # not whole 16-token blocks: the first-token proxy can continue
            "--output-len",
            "8",
            "--breakdown-concurrency",
            "2",
            "--short-input-len",
            "16",
            "--short-output-len",
            "8",
            "--short-prompts",
            "4",
            "--local-prefill-max-tokens",
            "28",  # above the short prompts (16), below the long ones (40)
            "--port-base",
            str(SMOKE_PORT_BASE),
            "--results-dir",
            str(results),
        ],
        1500,
        capsys,
    )
    try:
        assert code == 0, out[-3000:]
        run = _only_run_dir(results)
        for target in ("single", "pd", "pd-ft"):
            for level in (1, 2):
                r = json.loads((run / f"{target}-c{level}.json").read_text())
                assert r["completed"] == 4 and r["failed"] == 0, (target, level)
                assert r["max_concurrency"] == level and r["num_prompts"] == 4
                assert r["total_output_tokens"] == 4 * 8
                assert r["request_throughput"] > 0 and r["output_throughput"] > 0
                assert 0 < r["median_ttft_ms"] <= r["median_e2el_ms"]
                # >= 0: a busy CPU may merge a request's tokens into one chunk (flagged, below)
                assert r["median_tpot_ms"] >= 0 and r["median_itl_ms"] >= 0
                d = tables.delivery(r)  # measured; bursts on a busy machine are flagged
                assert d is not None and d.requests == 4 and 1.0 <= d.tokens_per_delivery <= 8
                assert (run / "logs" / f"{target}-c{level}.log").is_file()
        for part in (
            "single/logs/reference",
            "pd/logs/prefill",
            "pd/logs/decode",
            "pd/logs/proxy",
            "pd/logs/proxy-first-token",
            "pd/logs/proxy-local-prefill",
        ):
            assert (run / "servers" / f"{part}.log").is_file(), part
        table = (run / "table.md").read_text()
        assert table in out
        for needle in ("TTFT median", "TTFT p99", "TPOT", "ITL", "E2E", "requests/s", "tokens/s"):
            assert needle in table
        assert "P/D/single" in table and "where the P/D time to first token goes" in table
        for needle in ("1st-tok/single", "P/D handover per request", "goals (reported"):
            assert needle in table, needle
        summary = json.loads((run / "result.json").read_text())
        ratios = [row["pd_over_single"] for row in summary["table"]]
        assert all(r is not None and r > 0 for r in ratios)
        focus = {r["label"].strip(): r for r in summary["breakdown"][1]["rows"]}
        assert focus["proxy: prefill leg (sent -> JSON read)"]["count"] == 4
        assert focus["proxy: decode TTFB (incl. KV pull)"]["count"] == 4
        assert focus["decode vLLM: TTFT"]["count"] == 4
        assert focus["decode NIXL transfer (per xfer)"]["count"] >= 1  # the KV crossed NIXL
        assert focus["single vLLM: TTFT"]["count"] == 4
        assert focus["proxy own time before 1st byte"]["mean_ms"] is not None
        # the first-token proxy continued requests (the tiny model's token 1 may be a byte
        # token, which takes the normal flow: at least one continued)
        for key in ("1", "2"):
            assert summary["first_token"][key]["continued"] >= 1, summary["first_token"]
        handover = next(h for h in summary["handover"] if h["concurrency"] == 2)["modes"]
        for mode in ("pd", "pd-ft"):
            rows = {r["label"]: r for r in handover[mode]}
            for label in tables.HANDOVER_PHASE_LABELS.values():
                assert rows[label]["count"] == 4, (mode, label, rows[label])
            hold = next(r for label, r in rows.items() if label.startswith("prefill: KV hold"))
            assert hold["count"] >= 1, (mode, hold)  # the last ones may land after the scrape
            assert "(lease " in hold["label"]
        for name in ("single-short", "pd-short", "pd-local-short", "pd-local-long"):
            r = json.loads((run / f"{name}-c1.json").read_text())
            assert r["completed"] == 4 and r["failed"] == 0, name
        local = summary["local_prefill"]
        assert local["paths"]["short"]["measured"] is True, local["paths"]
        assert local["paths"]["long"]["measured"] is True, local["paths"]
        assert local["paths"]["short"]["local"] == 4 and local["paths"]["long"]["pd"] == 4
        assert all(g["met"] is not None for g in local["goals"]), local["goals"]
        assert "short prompts: single vs P/D vs P/D with --local-prefill-max-tokens 28" in table
        goals = [g for g in summary["goals"] if g["concurrency"] == 1]
        assert {g["mode"] for g in goals} == {"pd", "pd-ft"}
        assert all(g["met"] is not None for g in goals), goals  # measured, met or not
        data = json.loads((run / "manifest.json").read_text())
        assert data["mode"] == "local"
        assert re.fullmatch(r"[0-9a-f]{40}", data["git"]["commit"] or "")
        assert data["versions"]["vllm"] and data["versions"]["torch"] and data["versions"]["nixl"]
        assert data["host"]["logical_cpus"] >= 1 and data["host"]["cpu_model"]
        assert data["settings"]["proxy_port"] == SMOKE_PORT_BASE
        assert data["bench"]["prompts"] == {"1": 4, "2": 4}
        assert set(data["startup_s"]) == {"single", "pd"}
    finally:
        left = _leftovers(SMOKE_PORT_BASE, str(results))
        assert not left, f"processes left running: {left}"
    from pcp_pd_kit.localstack.host import port_is_free

    ports = [
        *spec.bench_ports(SMOKE_PORT_BASE).values(),
        spec.first_token_proxy_port(SMOKE_PORT_BASE),
        spec.local_prefill_proxy_port(SMOKE_PORT_BASE),
    ]
    busy = [p for p in ports if not port_is_free("127.0.0.1", p)]
    assert not busy, f"bench ports still bound: {busy}"


def test_the_serve_bench_runs_with_cache_aware_routing_off(tmp_path: Path) -> None:
    """Its workloads repeat prompts across targets: with cache-aware routing, the local-prefill
    proxy would send long prompts decode already holds to decode alone (the live smoke caught
    it). The serve bench measures prompt length; `bench cache` measures the cache."""
    from pcp_pd_kit.bench import runner
    from pcp_pd_kit.settings import parse_env_text, settings_from_env
    from tests.support.paths import REPO

    example = parse_env_text((REPO / ".env.example").read_text())
    base = settings_from_env({**example, "PREFIX_CACHE_ROUTING": "auto"})
    assert base.prefix_cache_routing == "auto"
    got = runner.prepare_local(base, SMOKE_PORT_BASE + 200, ["single"])
    assert got.prefix_cache_routing == "off" and got.local_prefill_max_tokens == 0
