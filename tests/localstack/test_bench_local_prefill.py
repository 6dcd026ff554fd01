"""Issue 27's part of the bench: the short-prompt workload on single, P/D and P/D through a
pd-proxy with --local-prefill-max-tokens (pd-local), the path check that keeps a run that did not
take the local path from reporting a ratio, the long-prompt check, and the tokenizer-cost table.
No servers: results and /metrics pages are built here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pcp_pd_kit.bench import local_prefill, spec, tables, tokenize_cost
from pcp_pd_kit.bench.histograms import counter_values
from pcp_pd_kit.bench.runner import (
    RunRecord,
    Scrape,
    counter_deltas_between,
    render,
)
from pcp_pd_kit.cli import main
from pcp_pd_kit.localstack.report import parse_metrics
from tests.support.bench_results import bench_result
from tests.support.env import example_settings

N = 64


def _result(ttft: float, completed: int = 32) -> dict[str, Any]:
    return bench_result(ttft, 1.0, completed)


def _page(local: float, pd: float) -> str:
    """A pd-proxy /metrics page with its request counter by path (and a first-token counter)."""
    return (
        "# TYPE pd_proxy_requests_total counter\n"
        f'pd_proxy_requests_total{{endpoint="/v1/completions",status="200",path="local"}} {local}\n'
        f'pd_proxy_requests_total{{endpoint="/v1/completions",status="200",path="pd"}} {pd}\n'
        'pd_proxy_requests_total{endpoint="/v1/chat/completions",status="200",path="pd"} 3.0\n'
        "# TYPE pd_proxy_first_token_requests_total counter\n"
        'pd_proxy_first_token_requests_total{outcome="continued",reason=""} 0.0\n'
    )


def _scrape(text: str) -> Scrape:
    """What the runner keeps of a proxy page: the counters tables.counter_metrics names."""
    samples = parse_metrics(text)
    return Scrape(
        counters={
            name: counter_values(samples, name, keep)
            for name, keep in tables.counter_metrics()["proxy"]
        }
    )


def _counters(before: tuple[float, float], after: tuple[float, float]) -> Any:
    """The runner's counter deltas of one run between two pages (local, pd)."""
    return counter_deltas_between(
        {"proxy": _scrape(_page(*before))}, {"proxy": _scrape(_page(*after))}
    )


# --- the path check ------------------------------------------------------------------------


def test_path_check_reads_the_proxys_counter_delta_by_path() -> None:
    # the warm-up's 2 requests came before the 'before' scrape: only the run's 32 count
    check = local_prefill.path_check(_counters((2, 2), (34, 2)), _result(20), "local")
    assert (check.local, check.pd, check.completed) == (32, 0, 32)
    assert check.measured and "all local" in check.text()
    long = local_prefill.path_check(_counters((34, 2), (34, 66)), _result(250, 64), "pd")
    assert long.measured and (long.local, long.pd) == (0, 64)


def test_a_run_that_did_not_take_the_local_path_is_not_measured() -> None:
    # N below the prompt: every request went P/D
    none = local_prefill.path_check(_counters((2, 0), (2, 32)), _result(250), "local")
    assert not none.measured and none.text().startswith("NOT MEASURED")
    # some local, some P/D: a mixed median, not the local path's
    mixed = local_prefill.path_check(_counters((0, 0), (30, 2)), _result(30), "local")
    assert not mixed.measured and "path pd 2" in mixed.text()
    # a long prompt that went local: the long check measured nothing
    assert not local_prefill.path_check(_counters((0, 0), (64, 0)), _result(9, 64), "pd").measured
    # no counter on the page (an older proxy, /metrics unreadable): nothing verified
    absent = local_prefill.path_check({"proxy": None}, _result(20), "local")
    assert (absent.local, absent.measured) == (None, False)
    assert "no pd_proxy_requests_total" in absent.text()
    # a run without a result verifies nothing either
    assert not local_prefill.path_check(_counters((0, 0), (32, 0)), None, "local").measured
    with pytest.raises(ValueError):
        local_prefill.path_check({}, None, "elsewhere")


# --- the tables and the goals ----------------------------------------------------------------

LOCAL_OK = local_prefill.PathCheck("local", 32, 0, 32)
LONG_OK = local_prefill.PathCheck("pd", 0, 64, 64)


def _goals(
    local_ttft: float,
    single_ttft: float = 20.0,
    short_check: local_prefill.PathCheck = LOCAL_OK,
    long_local: float = 260.0,
    long_pd: float = 250.0,
    long_check: local_prefill.PathCheck = LONG_OK,
) -> list[tables.Goal]:
    short = {
        "single": _result(single_ttft),
        "pd": _result(250.0),
        "pd-local": _result(local_ttft),
    }
    return local_prefill.goals(
        short, short_check, _result(long_pd, 64), _result(long_local, 64), long_check, N
    )


def test_short_goal_is_within_1_1x_of_single() -> None:
    met, long = _goals(22.0)
    assert met.met is True and met.value == pytest.approx(1.1)
    assert met.measured == "22.0 / 20.0 ms = 1.10x"
    missed = _goals(23.0)[0]
    assert missed.met is False and missed.verdict == "NOT MET"
    assert long.met is True and long.value == pytest.approx(260 / 250)


def test_goals_never_report_a_ratio_the_paths_do_not_back() -> None:
    not_local = local_prefill.PathCheck("local", 0, 32, 32)
    short, _ = _goals(22.0, short_check=not_local)
    assert short.met is None and short.value is None and "NOT MEASURED" in short.measured
    not_pd = local_prefill.PathCheck("pd", 64, 0, 64)
    _, long = _goals(22.0, long_check=not_pd)
    assert long.met is None and "NOT MEASURED" in long.measured
    rows = local_prefill.short_rows({"single": _result(20), "pd-local": _result(22)}, not_local)
    assert all(r["pd_local"] is None and r["pd_local_over_single"] is None for r in rows)


def test_long_prompts_unchanged_within_the_tolerance_both_ways() -> None:
    high = 1 + local_prefill.LONG_TOLERANCE
    low = 1 - local_prefill.LONG_TOLERANCE
    assert _goals(22, long_local=250 * (high - 0.01))[1].met is True
    assert _goals(22, long_local=250 * (high + 0.01))[1].met is False
    assert _goals(22, long_local=250 * (low - 0.01))[1].met is False  # faster is a change too


def test_goals_say_what_was_not_run() -> None:
    found = local_prefill.goals({"single": _result(20)}, None, None, None, None, N)
    assert [g.measured for g in found] == ["pd-local not run", "pd-local not run"]
    found = local_prefill.goals(
        {"pd-local": _result(20)}, LOCAL_OK, None, _result(250, 64), LONG_OK, N
    )
    assert [g.measured for g in found] == ["single not run", "P/D (long) not run"]
    assert all(g.met is None for g in found)


def test_short_table_marks_runs_not_measured_and_not_run() -> None:
    not_local = local_prefill.PathCheck("local", 0, 32, 32)
    text = local_prefill.format_short(
        {"single": _result(20.0), "pd-local": _result(250.0)},
        not_local,
        None,
        _result(250.0, 64),
        LONG_OK,
        input_len=32,
        long_input_len=250,
        max_tokens=N,
        ran_long_pd=False,
    )
    ttft = next(line for line in text.splitlines() if line.startswith("| TTFT median"))
    assert "not run" in ttft and "not meas." in ttft and "n/a" in ttft
    assert "NOT MEASURED: path local 0, path pd 32" in text


# --- the runner's plan and render ----------------------------------------------------------------


def test_run_order_pairs_the_short_and_the_long_runs() -> None:
    base = spec.BenchPlan(levels=(1, 4), prompts=(40, 64), input_len=250, output_len=64)
    short = spec.ShortPlan(input_len=32, output_len=16, prompts=24, max_tokens=N)
    pd_phase = ("pd", "pd-local", "pd-ft")
    order = spec.run_order(pd_phase, base, short, spec.TARGETS)
    assert [(t, w) for t, w, _ in order] == [
        ("pd", spec.MAIN),
        ("pd", spec.SHORT),
        ("pd-local", spec.SHORT),
        ("pd", spec.LONG),
        ("pd-local", spec.LONG),
        ("pd-ft", spec.MAIN),
    ]
    plans = {(t, w): p for t, w, p in order}
    assert plans[("pd", spec.MAIN)] is base
    s = plans[("pd-local", spec.SHORT)]
    assert (s.levels, s.prompts, s.input_len, s.output_len) == ((1,), (24,), 32, 16)
    long = plans[("pd-local", spec.LONG)]
    assert plans[("pd", spec.LONG)] == long
    assert (long.levels, long.prompts, long.input_len, long.output_len) == ((1,), (24,), 250, 16)
    single = spec.run_order(("single",), base, short, spec.TARGETS)
    assert [w for _, w, _ in single] == [spec.MAIN, spec.SHORT]
    # without pd-local: the main workload only, as before
    assert [w for _, w, _ in spec.run_order(("pd", "pd-ft"), base, short, ("pd", "pd-ft"))] == [
        spec.MAIN,
        spec.MAIN,
    ]
    # pd-local without pd: its own runs, nothing to pair with
    assert [(t, w) for t, w, _ in spec.run_order(("pd-local",), base, short, ("pd-local",))] == [
        ("pd-local", spec.SHORT),
        ("pd-local", spec.LONG),
    ]
    assert short.problems(base) == []
    assert len(spec.ShortPlan(input_len=64, max_tokens=N).problems(base)) == 1
    assert len(short.problems(spec.BenchPlan(input_len=N))) == 1
    with pytest.raises(spec.BenchSpecError):
        spec.ShortPlan(max_tokens=0)


def test_short_runs_have_their_own_result_files() -> None:
    target = spec.Target("pd-local", "http://127.0.0.1:18402", "tiny", "/models/tiny")
    plan = spec.ShortPlan().short(spec.BenchPlan())
    argv = spec.bench_serve_argv(target, plan, 1, "/tmp/r", workload=spec.SHORT)
    assert argv[argv.index("--result-filename") + 1] == "pd-local-short-c1.json"
    assert argv[argv.index("--random-input-len") + 1] == str(spec.DEFAULT_SHORT_INPUT_LEN)
    assert "workload=short" in argv
    assert spec.result_filename("pd", 4) == "pd-c4.json"


def test_render_keeps_short_runs_out_of_the_main_table() -> None:
    plan = spec.BenchPlan(levels=(1,), prompts=(64,))
    short = spec.ShortPlan(max_tokens=N)
    records = [
        RunRecord("single", 1, 64, 0, result=_result(30.0, 64)),
        RunRecord("pd", 1, 64, 0, result=_result(400.0, 64)),
        RunRecord("pd", 1, 32, 0, result=_result(250.0), workload=spec.LONG),
        RunRecord("single", 1, 32, 0, result=_result(20.0), workload=spec.SHORT),
        RunRecord("pd", 1, 32, 0, result=_result(240.0), workload=spec.SHORT),
        RunRecord(
            "pd-local",
            1,
            32,
            0,
            result=_result(21.0),
            counters=_counters((2, 2), (34, 2)),
            workload=spec.SHORT,
        ),
        RunRecord(
            "pd-local",
            1,
            64,
            0,
            result=_result(255.0),
            counters=_counters((34, 2), (34, 34)),
            workload=spec.LONG,
        ),
    ]
    text, summary = render(plan, records, [], short)
    main_ttft = next(r for r in summary["table"] if r["key"] == "median_ttft_ms")
    assert (main_ttft["single"], main_ttft["pd"]) == (30.0, 400.0)  # not the short runs
    local = summary["local_prefill"]
    ttft = next(r for r in local["short"] if r["key"] == "median_ttft_ms")
    assert (ttft["single"], ttft["pd"], ttft["pd_local"]) == (20.0, 240.0, 21.0)
    assert ttft["pd_local_over_single"] == pytest.approx(1.05)
    long = next(r for r in local["long"] if r["key"] == "median_ttft_ms")
    assert long["pd_local_over_pd"] == pytest.approx(255 / 250)
    assert [g["verdict"] for g in local["goals"]] == ["met", "met"]
    assert local["paths"]["short"]["local"] == 32 and local["paths"]["long"]["pd"] == 32
    assert "P/D+local proxy (N=64): path local 32, path pd 0 (of 32 completed): all local" in text
    assert "21.0 / 20.0 ms = 1.05x" in text
    # without pd-local the section is absent
    text, summary = render(plan, records[:3], [], short)
    assert summary["local_prefill"] is None and "short prompts" not in text


# --- the stack's third proxy ---------------------------------------------------------------------


def test_local_prefill_proxy_is_a_third_pd_proxy_with_n(tmp_path: Path) -> None:
    from pcp_pd_kit.localstack.model_source import ResolvedModel
    from pcp_pd_kit.localstack.stack import LOCAL_PREFILL_PROXY, PD_PARTS, Stack

    settings = example_settings(local_prefill_max_tokens=0)
    parts = ("prefill", "decode", "proxy", LOCAL_PREFILL_PROXY)
    stack = Stack(
        settings,
        parts=parts,
        work_dir=tmp_path,
        local_prefill_proxy_port=18998,
        local_prefill_max_tokens=N,
    )
    stack.model = ResolvedModel(path="/models/tiny", served_name="tiny")
    local = stack._spec(LOCAL_PREFILL_PROXY)
    normal = stack._spec("proxy")
    assert local.name == LOCAL_PREFILL_PROXY
    opt = local.argv.index("--local-prefill-max-tokens")
    assert local.argv[opt + 1] == str(N)
    assert normal.argv[normal.argv.index("--local-prefill-max-tokens") + 1] == "0"
    assert local.argv[local.argv.index("--port") + 1] == "18998"
    assert local.health_url == f"{settings.url(18998)}/health"
    assert stack._ports()[LOCAL_PREFILL_PROXY] == 18998
    assert LOCAL_PREFILL_PROXY not in PD_PARTS  # make up / make demo do not start it
    with pytest.raises(ValueError, match="local_prefill_max_tokens"):
        Stack(settings, parts=parts, work_dir=tmp_path)


def test_cli_bad_short_plan_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "serve", "--local-prefill-max-tokens", "0"]) == 2
    assert "--local-prefill-max-tokens must be >= 1" in capsys.readouterr().err


# --- the tokenizer cost ----------------------------------------------------------------------


def test_tokenize_body_is_what_the_proxy_sends() -> None:
    from pd_proxy.rewrite import CHAT_COMPLETIONS, COMPLETIONS
    from pd_proxy.routing.token_count import tokenize_body

    text = tokenize_cost.prompt_text(5)
    assert text == "the farmer sold seven eggs"
    assert tokenize_cost.prompt_text(len(tokenize_cost.WORDS) + 1).endswith("today the")
    chat = {"model": "m", "messages": [{"role": "user", "content": text}]}
    assert tokenize_cost.tokenize_body("m", "chat", text) == tokenize_body(chat, CHAT_COMPLETIONS)
    completions = {"model": "m", "prompt": text}
    assert tokenize_cost.tokenize_body("m", "completions", text) == tokenize_body(
        completions, COMPLETIONS
    )
    with pytest.raises(ValueError):
        tokenize_cost.prompt_text(0)


def test_tokenize_stats_and_table_flag_disagreeing_counts() -> None:
    stats = tokenize_cost.Stats.of([0.001, 0.002, 0.003, 0.004, 0.010])
    assert stats.n == 5 and stats.median_ms == pytest.approx(3.0)
    assert stats.p90_ms == pytest.approx(10.0) and stats.mean_ms == pytest.approx(4.0)
    with pytest.raises(ValueError):
        tokenize_cost.Stats.of([])
    same = tokenize_cost.Row("short", "chat", {"http": 40, "local": 40}, {"http": stats})
    differ = tokenize_cost.Row("long", "chat", {"http": 250, "local": 249}, {"local": stats})
    text = tokenize_cost.format_table([same, differ])
    assert "3.000 (10.000)" in text and "n/a" in text
    assert "WARNING: the counts differ" in text and "long, chat" in text.split("WARNING")[1]
    assert "WARNING" not in tokenize_cost.format_table([same])
    assert tokenize_cost.rows_json([same])[0]["counts_agree"] is True


def test_time_rows_split_the_local_paths_ttft_into_decode_and_proxy() -> None:
    from pcp_pd_kit.bench.histograms import Histogram

    def hist(total_s: float, n: int) -> Histogram:
        return Histogram(buckets=((0.025, n), (float("inf"), n)), sum=total_s, count=n)

    deltas = {
        "single": {"single": {local_prefill.TTFT_SECONDS: hist(0.32, 32)}},  # 10 ms
        "pd-local": {
            "proxy": {local_prefill.PROXY_TTFB_SECONDS: hist(1.92, 32)},  # 60 ms
            "decode": {local_prefill.TTFT_SECONDS: hist(1.28, 32)},  # 40 ms
        },
    }
    short = {"single": _result(10.5), "pd-local": _result(60.8)}
    rows = {r.label.strip(): r for r in local_prefill.time_rows(deltas, short)}
    assert rows["single vLLM: TTFT"].mean_ms == pytest.approx(10.0)
    assert rows["decode vLLM: TTFT (its own prefill)"].mean_ms == pytest.approx(40.0)
    assert rows["proxy around decode (/tokenize, legs)"].mean_ms == pytest.approx(20.0)
    assert rows["decode TTFT - single vLLM TTFT"].mean_ms == pytest.approx(30.0)
    assert rows["P/D+local - single, client TTFT"].p50_ms == pytest.approx(50.3)
    text = local_prefill.format_time_rows(list(rows.values()))
    assert "decode vLLM: TTFT (its own prefill)" in text and "0.00-25.0" in text
    # nothing scraped: n/a rows, not an error
    empty = local_prefill.time_rows({}, {})
    assert all(r.mean_ms is None for r in empty)


def test_short_table_warns_when_streams_arrived_in_bursts() -> None:
    bursty = {**_result(80.0, 2), "itls": [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], "output_lens": [4, 4]}
    smooth = {**_result(10.0, 2), "itls": [[0.01] * 3, [0.01] * 3], "output_lens": [4, 4]}

    def table(single: dict[str, Any]) -> str:
        return local_prefill.format_short(
            {"single": single, "pd-local": smooth},
            LOCAL_OK,
            None,
            None,
            None,
            input_len=32,
            long_input_len=250,
            max_tokens=N,
            ran_long_pd=False,
        )

    assert "single: 4.00 tokens per delivery" in table(bursty)
    assert "WARNING" not in table(smooth)
