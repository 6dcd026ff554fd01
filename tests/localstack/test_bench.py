"""bench serve: its plan, the report's pure parts against fake /metrics pages, the command
line's errors, remote mode with vLLM's real bench client, and (e2e) the whole run on the CPU
stack."""

from __future__ import annotations

import contextlib
import json
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
from pcp_pd_kit.bench import results
from pcp_pd_kit.bench import serve_plan as spec
from pcp_pd_kit.bench import serve_report as report
from pcp_pd_kit.bench.client import BenchError, grown, snapshot
from pcp_pd_kit.bench.metrics import Histogram, counter_delta, counter_values, delta, histogram
from pcp_pd_kit.bench.serve import WANTED, phases, resolve_api_key
from pcp_pd_kit.cli import main
from pcp_pd_kit.localstack.report import parse_metrics
from tests.support import procs
from tests.support.bench_results import bench_result
from tests.support.net import busy_port, closed_port_url


def test_levels_and_prompts_parse_and_reject() -> None:
    assert spec.parse_levels("1,4,16") == (1, 4, 16)
    assert spec.parse_prompts(None, (1, 4, 16)) == (64, 64, 128)
    assert spec.parse_prompts("8", (1, 4)) == (8, 8)
    assert spec.parse_prompts("3,5", (1, 4)) == (3, 5)
    for bad in ("", "0", "1,1", "x"):
        with pytest.raises(spec.BenchSpecError):
            spec.parse_levels(bad)
    with pytest.raises(spec.BenchSpecError):
        spec.parse_prompts("1,2,3", (1, 4))


def test_bench_ports_are_distinct_and_bounded() -> None:
    ports = spec.bench_ports(18400)
    assert len(set(ports.values())) == len(ports) and ports["proxy_port"] == 18400
    with pytest.raises(spec.BenchSpecError):
        spec.bench_ports(65500)


def test_focus_level_is_the_nearest_level_run() -> None:
    assert spec.BenchPlan(levels=(1, 8), prompts=(4, 4), breakdown_level=4).focus_level() == 1
    assert spec.BenchPlan(levels=(1, 4), prompts=(4, 4), breakdown_level=4).focus_level() == 4


def test_bench_serve_argv_fixes_dataset_lengths_seed_and_result() -> None:
    target = spec.Target("pd", "http://h:1/", "m", "/tok")
    argv = spec.bench_serve_argv(target, spec.BenchPlan(), 4, "/out", python="py")
    assert argv[:3] == ["py", "-m", "pcp_pd_kit.bench.vllm_serve"]
    pairs = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert pairs["--base-url"] == "http://h:1" and pairs["--random-range-ratio"] == "0"
    assert argv[argv.index("--random-input-len") + 1] == "250"
    assert argv[argv.index("--max-concurrency") + 1] == "4"
    assert argv[argv.index("--result-filename") + 1] == "pd-c4.json"
    assert "--ignore-eos" in argv and "--save-detailed" in argv
    short = spec.bench_serve_argv(target, spec.BenchPlan(), 1, "/out", workload=spec.SHORT)
    assert short[short.index("--result-filename") + 1] == "pd-short-c1.json"


def test_each_level_and_workload_gets_its_own_prompts_and_every_target_the_same() -> None:
    """With prefix caching on, a prompt sent at an earlier level is a cache hit at the next."""

    def seed(target: str, level: int, workload: str = spec.MAIN) -> str:
        plan = spec.BenchPlan(seed=7)
        argv = spec.bench_serve_argv(spec.Target(target, "http://h:1", "m", "/t"), plan, level,
                                     "/out", workload=workload)  # fmt: skip
        return argv[argv.index("--seed") + 1]

    runs = [(lv, w) for lv in (1, 4, 16) for w in (spec.MAIN, spec.SHORT, spec.LONG)]
    assert len({seed("pd", lv, w) for lv, w in runs}) == len(runs)
    assert all(seed("single", lv, w) == seed("pd", lv, w) for lv, w in runs)
    assert seed("pd", 1) == "8"


@pytest.mark.vllm
def test_bench_serve_argv_parses_with_vllms_own_parser() -> None:
    pytest.importorskip("vllm.benchmarks.serve")
    from pcp_pd_kit.bench.vllm_serve import build_parser

    target = spec.Target("pd", "http://h:1", "m", "/tok")
    args = build_parser().parse_args(spec.bench_serve_argv(target, spec.BenchPlan(), 4, "/o")[3:])
    assert args.max_concurrency == 4 and args.random_input_len == 250 and args.save_result


def test_run_order_pairs_the_short_and_the_long_runs() -> None:
    plan, short = spec.BenchPlan(), spec.ShortPlan()
    order = [(t, w) for t, w, _p in spec.run_order(list(spec.TARGETS), plan, short, spec.TARGETS)]
    assert order == [
        ("single", spec.MAIN), ("pd", spec.MAIN), ("single", spec.SHORT), ("pd", spec.SHORT),
        ("pd-local", spec.SHORT), ("pd", spec.LONG), ("pd-local", spec.LONG), ("pd-ft", spec.MAIN),
    ]  # fmt: skip
    assert phases(["single", "pd"]) == {
        "single": ("reference",),
        "pd": ("prefill", "decode", "proxy"),
    }
    assert phases(["pd-ft"])["pd"] == ("prefill", "decode", "proxy-first-token")


def test_histogram_and_counter_deltas() -> None:
    page = (
        'h_bucket{e="0",le="0.1"} 1\nh_bucket{e="0",le="+Inf"} 2\n'
        'h_sum{e="0"} 0.3\nh_count{e="0"} 2\n'
        'h_bucket{e="1",le="0.1"} 1\nh_bucket{e="1",le="+Inf"} 1\n'
        'h_sum{e="1"} 0.05\nh_count{e="1"} 1\n'
        'c_total{path="local"} 3\nc_total{path="pd"} 1\n'
    )
    before = histogram(parse_metrics(page), "h")
    assert before is not None and before.count == 3 and before.bucket_of(0.5) == (0.0, 0.1)
    after = Histogram(((0.1, 2.0), (float("inf"), 5.0)), 1.35, 5.0)
    d = delta(after, before)
    assert d is not None and d.count == 2 and d.mean == pytest.approx(0.5)
    assert delta(Histogram((), 0.0, 1.0), before) is None  # a restart: no delta
    counts = counter_values(parse_metrics(page), "c_total", ("path",))
    assert counts == {'c_total{path="local"}': 3.0, 'c_total{path="pd"}': 1.0}
    assert counter_delta({'c{path="pd"}': 5.0}, {'c{path="pd"}': 2.0}) == {'c{path="pd"}': 3.0}


def test_delivery_counts_bursts_and_merged_tokens() -> None:
    smooth = {"itls": [[0.01, 0.01]], "output_lens": [3]}
    merged = {"itls": [[0.0001, 0.0001]], "output_lens": [3]}
    assert report.delivery(smooth) == report.Delivery(1.0, 0, 1)
    assert report.delivery(merged) == report.Delivery(3.0, 1, 1)
    assert report.delivery({"itls": [], "output_lens": [1]}) is None


def _run(
    target: str, level: int, ttft: float, workload: str = spec.MAIN, **counters: float
) -> report.Run:
    run = report.Run(target, level, 4, workload, result=bench_result(ttft, 4), returncode=0)
    run.counters = (
        {"proxy": {k.replace("_", " "): v for k, v in counters.items()}} if counters else {}
    )
    return run


def _ft(level: int, ttft: float, continued: float, normal: float = 0.0) -> report.Run:
    run = report.Run("pd-ft", level, 4, result=bench_result(ttft, 4), returncode=0)
    name = report.FIRST_TOKEN_COUNTER
    run.counters = {
        "proxy": {
            f'{name}{{outcome="continued",reason=""}}': continued,
            f'{name}{{outcome="normal",reason="logprobs"}}': normal,
        }
    }
    return run


def _local(workload: str, ttft: float, local: float, pd: float) -> report.Run:
    run = report.Run("pd-local", 1, 4, workload, result=bench_result(ttft, 4), returncode=0)
    name = report.REQUESTS_COUNTER
    run.counters = {"proxy": {f'{name}{{path="local"}}': local, f'{name}{{path="pd"}}': pd}}
    return run


def test_checks_back_a_figure_only_when_the_proxy_did_what_its_column_says() -> None:
    assert report.first_token_check(_ft(1, 10, 3, 1)).measured
    failed = report.first_token_check(_ft(1, 10, 0, 4))
    assert (
        not failed.measured and failed.text.startswith("NOT MEASURED") and "logprobs" in failed.text
    )
    assert not report.first_token_check(report.Run("pd-ft", 1, 4)).measured  # no counter read
    assert report.check(_local(spec.SHORT, 10, 4, 0)).measured  # type: ignore[union-attr]
    assert not report.check(_local(spec.SHORT, 10, 3, 1)).measured  # type: ignore[union-attr]
    assert report.check(_local(spec.LONG, 10, 0, 4)).measured  # type: ignore[union-attr]
    assert report.check(_run("pd", 1, 10)) is None


def _runs() -> dict[tuple[str, str, int], report.Run]:
    runs = [
        _run("single", 1, 10.0), _run("pd", 1, 40.0), _ft(1, 11.0, 4),
        _run("single", 4, 20.0), _run("pd", 4, 80.0), _ft(4, 29.0, 0, 4),
        _run("single", 1, 10.0, spec.SHORT), _run("pd", 1, 50.0, spec.SHORT),
        _local(spec.SHORT, 10.5, 4, 0), _run("pd", 1, 40.0, spec.LONG),
        _local(spec.LONG, 44.0, 0, 4),
    ]  # fmt: skip
    return {(r.workload, r.target, r.level): r for r in runs}


def test_tables_put_targets_side_by_side_and_refuse_unmeasured_ratios() -> None:
    runs = _runs()
    rows = {(r["concurrency"], r["key"]): r for r in report.table_rows(runs, spec.MAIN)}
    assert rows[(1, "median_ttft_ms")]["ratios"] == {"pd": 4.0, "pd-ft": 1.1}
    assert rows[(4, "median_ttft_ms")]["ratios"]["pd-ft"] is None  # nothing continued at c=4
    text = report.format_table(runs, spec.MAIN)
    assert "| c | metric | single | P/D | P/D 1st-tok | P/D/single | P/D 1st-tok/single |" in text
    assert "not meas." in text and "NOT MEASURED" in text
    long = report.table_rows(runs, spec.LONG)
    assert long[0]["ratios"] == {"pd-local": pytest.approx(1.1)}


def test_each_run_reports_its_servers_prefix_cache_hit_rate() -> None:
    runs = _runs()
    cache = {report.PREFIX_QUERIES: 1000.0, report.PREFIX_HITS: 496.0}
    runs[(spec.MAIN, "single", 4)].counters["server"] = cache
    runs[(spec.MAIN, "pd", 4)].counters |= {"prefill": {report.PREFIX_QUERIES: 800.0},
                                           "server": {report.PREFIX_QUERIES: 0.0}}  # fmt: skip
    assert runs[(spec.MAIN, "single", 4)].hit_rates() == {"server": pytest.approx(0.496)}
    assert runs[(spec.MAIN, "pd", 4)].hit_rates() == {"prefill": 0.0, "decode": None}
    text = report.format_table(runs, spec.MAIN)
    assert "|  | prefix-cache hit rate | 49.6% | prefill 0.0% / decode n/a |" in text
    _text, _result, figures = report.render(spec.BenchPlan(levels=(1, 4), prompts=(4, 4)),
                                            spec.ShortPlan(), list(runs.values()))  # fmt: skip
    assert figures["prefix_cache_hit_rate"]["single c=4"] == {"server": pytest.approx(0.496)}


def test_goals_are_measured_met_or_say_why_not() -> None:
    found = {g["goal"]: g for g in report.goals(_runs())}
    assert found["main: TTFT median P/D/single <= 1.2x, c=1"]["met"] is False
    assert found["main: TTFT median P/D 1st-tok/single <= 1.2x, c=1"]["met"] is True
    assert found["main: TTFT median P/D 1st-tok/single <= 1.5x, c=4"]["met"] is None
    assert found["short: TTFT median P/D+local/single <= 1.1x, c=1"]["met"] is True
    assert found["long: TTFT median P/D+local/P/D 0.85-1.15x, c=1"]["met"] is True
    assert report.goals({})[0]["measured"] == "not run"


def test_render_writes_every_workload_the_breakdown_and_the_errors() -> None:
    runs = list(_runs().values())
    text, result, figures = report.render(
        spec.BenchPlan(levels=(1, 4), prompts=(4, 4)), spec.ShortPlan(), runs, ["P/D: boom"]
    )
    for needle in (
        "== 250 in / 64 out tokens ==",
        "== short prompts",
        "== long prompts",
        "== goals ==",
        "P/D: boom",
    ):
        assert needle in text, needle
    assert "where TTFT goes, main workload, c=4" in text
    assert set(figures["tables"]) == {"main", "short", "long"}
    assert len(result["runs"]) == len(runs) and "runs" not in figures
    json.dumps(result)  # JSON-ready


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
            for phase, took in zip(report.PHASE_LABELS, steps, strict=False):
                self.handover["decode"][phase].observe(took)
            self.handover["decode"]["admitted_to_first_token"].observe(admitted_to_first)
            self.handover["prefill"]["prefill_kv_hold"].observe(0.18)
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
) -> report.Run:
    """One run as serve.run_target records it: scrape, serve requests, scrape again."""
    for source, registry in fake.registries.items():
        registries[f"{target}-{source}"] = registry
    names = {"prefill": "prefill", "decode": "server", "proxy": "proxy"}
    sources = {names[s]: f"{url}/{target}-{s}" for s in fake.registries}
    before = snapshot(sources, WANTED)
    serve()
    run = report.Run(target, level, 4)
    run.deltas, run.counters, run.gauges = grown(before, snapshot(sources, WANTED))
    return run


PD_STEPS = (0.002, 0.049, 0.0004, 0.014)  # 65.4 ms admitted -> first token
FT_STEPS = (0.001, 0.004, 0.0004, 0.0036)  # 9 ms


def test_the_breakdown_reads_the_handover_from_metrics(pages: tuple[str, dict[str, Any]]) -> None:
    url, registries = pages
    fake = _FakePd(first_token=False)
    fake.serve(2, (0.5,))  # warm-up before the first scrape: not counted
    run = _measure(url, registries, "pd", 1, fake, lambda: fake.serve(4, PD_STEPS))
    run.result = bench_result(90.0, 4)
    rows = {r["label"]: r for r in report.breakdown(run)}
    overall = rows["decode: admitted -> first token (all)"]
    assert overall["count"] == 4 and overall["mean_ms"] == pytest.approx(65.4)
    assert rows["prefill: KV hold, done -> freed (lease 30 s)"]["count"] == 4
    outside = rows["derived: decode TTFB outside the handover"]["mean_ms"]
    assert outside == pytest.approx(8.0)
    assert rows["vLLM TTFT (single, or decode)"]["mean_ms"] is None  # not exported: n/a


def test_api_key_precedence(tmp_path: Path) -> None:
    import argparse

    key_file = tmp_path / "keys"
    key_file.write_text("# comment\n sk-file \n")
    ns = argparse.Namespace(api_key=None, api_key_file=str(key_file))
    assert resolve_api_key(ns, {"OPENAI_API_KEY": "sk-env"}) == "sk-file"
    ns.api_key = "sk-flag"
    assert resolve_api_key(ns, {}) == "sk-flag"
    empty = tmp_path / "empty"
    empty.write_text("# none\n")
    with pytest.raises(BenchError):
        resolve_api_key(argparse.Namespace(api_key=None, api_key_file=str(empty)), {})


def test_argv_redaction_hides_the_key_in_both_spellings() -> None:
    argv = ["x", "--api-key", "sk-1", "--api-key=sk-2", "--api-key-file", "f"]
    assert results.redact_argv(argv) == [
        "x",
        "--api-key",
        "<redacted>",
        "--api-key=<redacted>",
        "--api-key-file",
        "f",
    ]


def test_cli_bad_concurrency_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "serve", "--concurrency", "0", "--results-dir", str(tmp_path)]) == 2
    assert "--concurrency" in capsys.readouterr().err and list(tmp_path.iterdir()) == []


def test_cli_unreachable_deployment_starts_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["bench", "serve", "--base-url", closed_port_url(), "--results-dir", str(tmp_path)])
    assert code == 2 and "no answer" in capsys.readouterr().err
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

    # its own page: the client TTFB histogram; a given registry has it already (_FakePd)
    duration = "pd_proxy_time_to_first_byte_seconds" if registry is None else "fake_seconds"
    registry = CollectorRegistry() if registry is None else registry
    handler = type(
        "FakeProxy",
        (_FakeProxy,),
        {
            "model_root": resolve_model("", "", repo_root()).path,  # builds the tiny model
            "seen": {},
            "lock": threading.Lock(),
            "registry": registry,
            "durations": PromHistogram(duration, "d", registry=registry),
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
    focus = next(b for b in summary["breakdown_every_level"] if b["concurrency"] == 2)
    ttfb = next(r for r in focus["rows"] if r["label"] == "proxy: client TTFB")
    assert ttfb["count"] == 3  # its /metrics read with the key, around that run only
    data = json.loads((run / "manifest.json").read_text())
    assert data["mode"] == "remote" and data["settings"] is None
    assert data["targets"]["pd"] == url
    assert json.loads((run / "summary.json").read_text())["figures"]["tables"]["main"]
    for path in run.rglob("*"):
        if path.is_file():
            assert API_KEY not in path.read_text(errors="replace"), path
    assert "TTFT median" in out and "not run" in out  # no single: its column is n/a
    # no goal could be measured without single: none listed, the count said instead
    assert "TTFT median P/D/single" not in out.split("== goals ==")[1]
    assert "none measured" in out and "6 more not run" in out


@pytest.mark.vllm
@pytest.mark.slow
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
    [ft] = [c for c in summary["checks"] if c["run"] == "P/D 1st-tok c=1"]
    assert ft["counts"]["continued"] == 3 and ft["measured"] is True  # the warm-up's 2 before
    for mode, took in (("pd", 65.4), ("pd-ft", 9.0)):
        [focus] = [b for b in summary["breakdown_every_level"] if b["target"] == mode]
        rows = {r["label"]: r for r in focus["rows"]}
        overall = rows["decode: admitted -> first token (all)"]
        assert overall["count"] == 3 and overall["mean_ms"] == pytest.approx(took)
        assert rows["prefill: KV hold, done -> freed (lease 30 s)"]["count"] == 3
    goals = {g["goal"]: g for g in summary["goals"]}
    assert goals["main: TTFT median P/D 1st-tok/single <= 1.2x, c=1"]["measured"] == "not run"
    data = json.loads((run / "manifest.json").read_text())
    assert data["targets"]["pd-ft"] == first_token
    assert "P/D 1st-tok c=1: continued 3" in out
    assert "where TTFT goes, main workload, c=1" in out


# --- end to end on the real CPU stack ----------------------------------------------------------

SMOKE_PORT_BASE = 18600  # apart from make up (18000s), make bench (18400s), e2e (18500s)


def _leftovers(port_base: int, marker: str) -> list[str]:
    """Processes still holding a bench port or running a bench client for this run."""
    import psutil

    ports = {str(p) for p in spec.bench_ports(port_base).values()}
    ports |= {str(port_base + spec.FIRST_TOKEN_PROXY_OFFSET)}
    ports |= {str(port_base + spec.LOCAL_PREFILL_PROXY_OFFSET)}
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
@pytest.mark.slow
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
                d = report.delivery(r)  # measured; bursts on a busy machine are flagged
                assert d is not None and d.requests == 4 and 1.0 <= d.tokens_per_delivery <= 8
                assert (run / "logs" / f"{target}-c{level}.log").is_file()
        for part in (
            "single/logs/reference",
            "pd/logs/decode",
            "pd/logs/prefill",
            "pd/logs/proxy",
            "pd/logs/proxy-first-token",
            "pd/logs/proxy-local-prefill",
        ):
            assert (run / "servers" / f"{part}.log").is_file(), part
        table = (run / "table.md").read_text()
        assert table in out
        for needle in ("TTFT median", "TPOT", "ITL", "E2E", "requests/s", "P/D/single"):
            assert needle in table, needle
        for needle in ("P/D 1st-tok/single", "where TTFT goes, main workload, c=2", "== goals =="):
            assert needle in table, needle
        summary = json.loads((run / "result.json").read_text())
        main_rows = summary["tables"]["main"]
        assert all(r["ratios"]["pd"] > 0 for r in main_rows), main_rows
        checks = {c["run"]: c for c in summary["checks"]}
        # the first-token proxy continued requests (the tiny model's token 1 may be a byte
        # token, which takes the normal flow: at least one continued)
        for level in (1, 2):
            assert checks[f"P/D 1st-tok c={level}"]["counts"]["continued"] >= 1, checks
        assert checks["P/D+local (short) c=1"]["counts"] == {"local": 4, "pd": 0}, checks
        assert checks["P/D+local (long) c=1"]["counts"] == {"local": 0, "pd": 4}, checks
        where = summary["breakdown"]["main"]
        for mode in ("pd", "pd-ft"):
            rows = {r["label"]: r for r in where[mode]}
            for label in report.PHASE_LABELS.values():
                assert rows[label]["count"] == 4, (mode, label, rows[label])
            assert rows["decode: admitted -> first token (all)"]["mean_ms"] > 0
            assert rows["· NIXL transfer (per xfer)"]["count"] >= 1  # the KV crossed NIXL
            hold = next(r for label, r in rows.items() if label.startswith("prefill: KV hold"))
            assert hold["count"] >= 1 and "(lease " in hold["label"], (mode, hold)
        single = {r["label"]: r for r in where["single"]}
        assert single["vLLM TTFT (single, or decode)"]["count"] == 4
        for name in ("single-short", "pd-short", "pd-local-short", "pd-local-long"):
            r = json.loads((run / f"{name}-c1.json").read_text())
            assert r["completed"] == 4 and r["failed"] == 0, name
        assert all(g["met"] is not None for g in summary["goals"] if g["goal"].endswith("c=1"))
        data = json.loads((run / "manifest.json").read_text())
        assert data["mode"] == "local"
        assert re.fullmatch(r"[0-9a-f]{40}", data["git"]["commit"] or "")
        assert data["versions"]["vllm"] and data["versions"]["torch"] and data["versions"]["nixl"]
        assert data["host"]["logical_cpus"] >= 1 and data["host"]["cpu_model"]
        assert data["settings"]["proxy_port"] == SMOKE_PORT_BASE
        assert data["bench"]["prompts"] == {"1": 4, "2": 4}
        assert set(data["startup_s"]) == {"single", "pd"}
        brief = json.loads((run / "summary.json").read_text())
        assert brief["figures"]["goals"] == summary["goals"] and "runs" not in brief["figures"]
        assert (run / "summary.md").read_text().startswith("# bench serve, ")
    finally:
        left = _leftovers(SMOKE_PORT_BASE, str(results))
        assert not left, f"processes left running: {left}"
    from pcp_pd_kit.localstack.host import port_is_free

    ports = [
        *spec.bench_ports(SMOKE_PORT_BASE).values(),
        SMOKE_PORT_BASE + spec.FIRST_TOKEN_PROXY_OFFSET,
        SMOKE_PORT_BASE + spec.LOCAL_PREFILL_PROXY_OFFSET,
    ]
    busy = [p for p in ports if not port_is_free("127.0.0.1", p)]
    assert not busy, f"bench ports still bound: {busy}"


def test_the_serve_bench_runs_with_cache_aware_routing_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its workloads repeat prompts across targets: with cache-aware routing the local-prefill
    proxy would send long prompts decode already holds to decode alone (the live smoke caught
    it). The serve bench measures prompt length; `bench cache` measures the cache."""
    from pcp_pd_kit.bench.serve import local_settings

    monkeypatch.setenv("PREFIX_CACHE_ROUTING", "auto")
    monkeypatch.setenv("LOCAL_PREFILL_MAX_TOKENS", "9")
    settings = local_settings(18400)
    assert settings.prefix_cache_routing == "off" and settings.local_prefill_max_tokens == 0
    assert settings.proxy_port == 18400
