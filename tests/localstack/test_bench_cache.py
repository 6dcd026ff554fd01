"""`pcp-pd-kit bench cache`: its command lines, workloads, tables and goals, with fakes (the live
figures are in docs/bench.md)."""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pcp_pd_kit.bench import cache, cache_plan, cache_report, kinds, serve_plan
from pcp_pd_kit.bench.client import Scrape
from pcp_pd_kit.bench.results import Outcome
from pcp_pd_kit.cli import main
from pcp_pd_kit.localstack.commands import ProcessSpec, proxy_spec
from pcp_pd_kit.settings import kit_env, settings_from_env
from pd_proxy.config import load_config

PLAN = cache_plan.CachePlan()


def _args(**over: Any) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cache.add_arguments(parser)
    return argparse.Namespace(**{**vars(parser.parse_args([])), **over})


# --- knobs and command lines -------------------------------------------------------------------
def test_the_defaults_pass_and_a_cache_holding_every_prefix_is_refused() -> None:
    assert cache.check(_args()) is None
    # 8 prefixes x 512 tokens = 256 blocks of 16: 256 blocks would hold them all.
    problem = cache.check(_args(kv_blocks=256))
    assert problem is not None and "--kv-blocks 256 holds every prefix" in problem


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"new": 64}, "--new 64 must be below --local-max-tokens 64"),
        ({"context": 60}, "--context 60 must exceed --local-max-tokens 64"),
        ({"kv_blocks": 40}, "below the decodes' --max-model-len 1024"),
        ({"conversations": 0}, "--conversations must be >= 1"),
        ({"concurrency": "1,x"}, "--concurrency '1,x'"),
        ({"skip": "warmup"}, "--skip ['warmup']"),
    ],
)
def test_bad_knobs_are_named_before_anything_starts(over: dict[str, Any], needle: str) -> None:
    problem = cache.check(_args(**over))
    assert problem is not None and needle in problem


def test_bench_cache_is_a_kind_and_a_bad_option_exits_2_without_writing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert {"cache", "prefix-ttft"} <= set(kinds.KINDS)
    assert main(["bench", "cache", "--new", "70", "--results-dir", str(tmp_path)]) == 2
    assert "--new 70 must be below --local-max-tokens 64" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_kv_events_are_added_once_with_the_benchs_port() -> None:
    spec = ProcessSpec("decode", ["vllm", "--kv-events-config", '{"endpoint": "tcp://*:5557"}'])
    once = cache_plan.with_kv_events(spec, 18454)
    twice = cache_plan.with_kv_events(cache_plan.with_kv_events(spec, 1), 18454)
    assert once.argv == twice.argv and once.argv.count(cache_plan.KV_EVENTS_FLAG) == 1
    config = json.loads(once.argv[-1])
    assert config["endpoint"] == "tcp://*:18454" and config["replay_endpoint"] == "tcp://*:18455"
    equals = ProcessSpec("d", ["vllm", f"{cache_plan.KV_EVENTS_FLAG}={{}}", "--port", "1"])
    assert cache_plan.with_kv_events(equals, 7).argv[:3] == ["vllm", "--port", "1"]


@pytest.mark.vllm
def test_the_kv_events_config_is_one_vllm_accepts() -> None:
    from vllm.config.kv_events import KVEventsConfig

    config = KVEventsConfig(**json.loads(cache_plan.kv_events_config(18450)))
    assert config.enable_kv_cache_events and config.publisher == "zmq"
    assert config.endpoint == "tcp://*:18450" and config.replay_endpoint == "tcp://*:18451"


def test_the_shared_prefix_proxies_see_both_decodes_and_their_routing(tmp_path: Path) -> None:
    """The kit's proxy command line plus the bench's flags, read by pd-proxy's own parser."""
    settings = cache._settings(18400)
    a_only = cache.dataclasses.replace(settings, decode_port=18440)
    proc = cache.proxy_process(
        a_only,
        "proxy-events",
        18405,
        1024,
        cache_plan.proxy_flags("events", "/models/tiny", ["http://127.0.0.1:18442"]),
        tmp_path,
    )
    config = load_config(proc.spec.argv[3:], environ={})
    assert config.decode == ("http://127.0.0.1:18440", "http://127.0.0.1:18442")
    assert (config.prefix_cache_routing, config.tokenizer) == ("events", "/models/tiny")
    assert (config.port, config.local_prefill_max_tokens) == (18405, 1024)
    assert proc.name == "proxy-events"
    plain = load_config(proxy_spec(settings).argv[3:], environ={})
    assert plain.local_prefill_max_tokens == 0  # the stack's own proxy never counts


def test_a_second_decode_gets_its_own_ports_a_small_cache_and_the_dev_endpoints(
    tmp_path: Path,
) -> None:
    settings = cache._settings(18400)
    model = cache.ResolvedModel(path="/models/tiny", served_name="tiny")
    proc = cache.decode_process(
        settings, model, "decode-b", (18442, 18443, 18456), "0", PLAN, Path("/repo"), tmp_path
    )
    argv = proc.spec.argv
    assert argv[argv.index("--port") + 1] == "18442"
    assert argv[argv.index("--num-gpu-blocks-override") + 1] == str(PLAN.kv_blocks)
    lens = [argv[i + 1] for i, a in enumerate(argv) if a == "--max-model-len"]
    assert lens[-1] == str(PLAN.shared_max_model_len)  # the last value wins
    assert proc.spec.env["VLLM_SERVER_DEV_MODE"] == "1"
    assert proc.spec.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "18443"
    assert json.loads(argv[-1])["endpoint"] == "tcp://*:18456"
    assert "--enable-prefix-caching" in argv


@pytest.mark.vllm
def test_the_shared_prefix_run_parses_with_vllms_own_parser() -> None:
    pytest.importorskip("vllm.benchmarks.serve")
    from pcp_pd_kit.bench.vllm_serve import build_parser

    argv = cache_plan.prefix_bench_argv("http://h:1/", "tiny", "/m", PLAN, 5, "/out", "r.json")
    args = build_parser().parse_args(argv[3:])
    assert args.dataset_name == "prefix_repetition" and args.base_url == "http://h:1"
    assert (args.prefix_repetition_prefix_len, args.prefix_repetition_num_prefixes) == (512, 8)
    assert args.num_prompts == PLAN.prefixes * PLAN.per_prefix and args.max_concurrency == 4
    assert args.ready_check_timeout_sec == 0  # no test request caching a prefix early
    assert (args.seed, args.result_filename) == (5, "r.json")


def test_ideal_hits_count_whole_blocks_of_each_repeat() -> None:
    # 512 tokens + a BOS = 32 whole blocks of 16; 8 prefixes x 5 repeats each.
    assert cache_plan.ideal_hit_tokens(PLAN, 16, 1) == 8 * 5 * 32 * 16
    assert cache_plan.prefix_blocks(500, 16, 1) == 31


def test_prompts_and_rotation() -> None:
    first, follow = cache_plan.conversation(3, 100, 7)
    assert follow[:100] == first and len(follow) == 107
    assert cache_plan.short_prompt(1, 28) != cache_plan.short_prompt(2, 28)
    assert len(cache_plan.short_prompt(1, 28).split()) == 28
    assert [cache_plan.rotation("abc", i)[0] for i in range(3)] == ["a", "b", "c"]


# --- clients ---------------------------------------------------------------------------------
def test_conversations_run_concurrently_and_return_follow_up_ttfts_in_order() -> None:
    plan = cache_plan.CachePlan(context=80, new=8, think_ms=0)
    sent: list[tuple[int, int]] = []
    active, peak = [0], [0]
    lock = threading.Lock()
    overlapped = threading.Event()

    def send(url: str, body: dict[str, object]) -> float:
        prompt = body["prompt"]
        assert isinstance(prompt, list) and url == "http://u"
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
            sent.append((len(prompt), prompt[0]))
            if active[0] == 2:
                overlapped.set()
        # Until two sends have overlapped, each waits for that (30 s at most): 20 ms alone let a
        # loaded host start the pool's second thread only after the first had done everything.
        overlapped.wait(timeout=30)
        time.sleep(0.02)
        with lock:
            active[0] -= 1
        return len(prompt) / 1000

    out = cache.follow_up_ttfts("http://u", "m", [1, 3, 5, 7], plan, 2, send)
    assert out == [0.088] * 4 and peak[0] == 2
    assert sorted(n for n, _ in sent) == [80] * 4 + [88] * 4


def test_counter_growth_and_paths() -> None:
    before = {"p": {'pd_proxy_requests_total{path="local"}': 2.0}}
    after = {
        "p": {
            'pd_proxy_requests_total{path="local"}': 10.0,
            'pd_proxy_requests_total{path="pd"}': 8.0,
        }
    }
    grown = cache.counter_growth(before, after)["p"]
    assert cache_report.paths(grown) == {"local": 8.0, "pd": 8.0}
    assert cache_report.path_check(grown, 8).measured
    check = cache_report.path_check(grown, 9)
    assert not check.measured and check.text().startswith("NOT MEASURED")


# --- tables and goals ------------------------------------------------------------------------
def _multi(kit: float, single: float, local: float) -> dict[int, dict[str, Any]]:
    return {
        1: {
            "ttft_s": {"kit": [kit, kit, 9.0], "single": [single, single, 0.001]},
            "conversations": 3,
            "proxy": {
                'pd_proxy_requests_total{path="local"}': local,
                'pd_proxy_requests_total{path="pd"}': 3.0,
            },
        }
    }


def test_follow_up_goal_met_not_met_and_not_measured() -> None:
    met = cache_report.goals(cache_report.multi_turn_rows(_multi(0.040, 0.038, 3)), [], [])
    assert met[0].met is True and "40.0 / 38.0 ms = 1.05x" in met[0].measured
    slow = cache_report.goals(cache_report.multi_turn_rows(_multi(0.050, 0.038, 3)), [], [])
    assert slow[0].met is False
    # Two of three follow-ups went P/D: the kit's column is not the decode-alone path.
    wrong = cache_report.goals(cache_report.multi_turn_rows(_multi(0.040, 0.038, 1)), [], [])
    assert wrong[0].met is None and wrong[0].measured.startswith("NOT MEASURED")


def _shared(mode: str, ttft: float, hits: float) -> dict[str, Any]:
    return {
        "mode": mode,
        "round": 1,
        "result": {"median_ttft_ms": ttft, "p99_ttft_ms": ttft * 2, "completed": 48},
        "decodes": {
            "decode-a": {
                "vllm:prefix_cache_hits_total": hits / 2,
                "vllm:request_success_total": 24,
            },
            "decode-b": {
                "vllm:prefix_cache_hits_total": hits / 2,
                "vllm:request_success_total": 24,
            },
        },
        "proxy": {},
    }


def test_shared_prefix_goals_compare_routings_and_ideal() -> None:
    ideal = 20480
    rows = cache_report.shared_rows(
        [
            _shared("events", 30.0, 19456),
            _shared("off", 80.0, 10240),
            _shared("off", 60.0, 12000),
            _shared("events", 40.0, 20000),
        ],
        ideal,
    )
    summary = cache_report.shared_summary(rows)
    assert summary["events"]["ttft_ms"] == 35.0 and summary["off"]["ttft_ms"] == 70.0
    found = {g.goal: g for g in cache_report.goals([], [], rows)}
    hit = next(g for k, g in found.items() if "of ideal" in k)
    ttft = next(g for k, g in found.items() if "least outstanding" in k)
    assert hit.met is True and hit.value == pytest.approx((19456 / ideal + 20000 / ideal) / 2)
    assert ttft.met is True and ttft.value == pytest.approx(0.5)
    text = cache_report.format_shared(rows, ideal, "two decodes", 48)
    assert "| 1 | cache-aware (events) | 30.0 | 60.0 | 48/48 | 19456 | 0.95 | 24 / 24 |" in text


def _short_goal(goals: list[cache_report.Goal]) -> cache_report.Goal:
    return next(g for g in goals if g.mode == "tokenizer")


def test_short_goal_needs_every_proxy_request_on_decode_alone() -> None:
    local = {'pd_proxy_requests_total{path="local"}': 2.0}
    run = {
        "ttft_s": {"single": [0.030, 0.030], "tokenize": [0.040] * 2, "tokenizer": [0.032] * 2},
        "requests": 2,
        "proxies": {"tokenize": local, "tokenizer": local},
    }
    rows = cache_report.short_rows(run)
    goal = _short_goal(cache_report.goals([], rows, []))
    assert goal.met is True and "32.0 / 30.0 ms = 1.07x" in goal.measured
    run["proxies"] = {"tokenize": local, "tokenizer": {}}
    goal = _short_goal(cache_report.goals([], cache_report.short_rows(run), []))
    assert goal.met is None and goal.measured.startswith("NOT MEASURED")


def test_render_writes_markdown_tables_and_fails_on_a_failed_run() -> None:
    data = {
        "plan": PLAN.as_dict(),
        "errors": [],
        "multi_turn": _multi(0.040, 0.038, 3),
        "shared": [{**_shared("events", 30.0, 19456), "returncode": 1}],
        "added_special_tokens": 1,
    }
    outcome = cache.render(data, PLAN, 16)
    assert isinstance(outcome, Outcome) and outcome.rc == 1
    assert "| c | kit TTFT p50 (ms) | single TTFT p50 (ms) | kit/single |" in outcome.table
    assert "shared run 1 (events): exit 1" in outcome.table
    json.dumps(outcome.result)  # result.json must be writable
    # The committable summary: the rows, goals and errors, not the raw per-request data.
    assert set(outcome.summary) >= {"multi_turn_rows", "shared_rows", "held_rows", "goals"}
    assert "multi_turn" not in outcome.summary and "shared" not in outcome.summary
    assert outcome.summary["errors"] == ["shared run 1 (events): exit 1"]
    data["shared"][0]["returncode"] = 0
    assert cache.render(data, PLAN, 16).rc == 0


def test_the_stack_settings_turn_prefix_caching_on() -> None:
    base = settings_from_env(kit_env({"PREFIX_CACHING": "false", "KIT_DOTENV": ""}))
    assert base.prefix_caching is False
    settings = cache._settings(18400)
    assert settings.prefix_caching and settings.reference_port == 18430


def test_the_stacks_prefill_and_decode_publish_on_their_own_ports(tmp_path: Path) -> None:
    ports = serve_plan.bench_ports(18400, cache_plan.PORT_OFFSETS)
    stack = cache.EventsStack(
        cache._settings(18400),
        parts=cache.STACK_PARTS,
        work_dir=tmp_path,
        events_ports={"prefill": ports["events-prefill"], "decode": ports["events-decode"]},
    )
    stack.model = cache.ResolvedModel(path="/models/tiny", served_name="tiny")
    endpoints = {
        part: json.loads(stack._spec(part).argv[-1])["endpoint"] for part in ("prefill", "decode")
    }
    assert endpoints == {"prefill": "tcp://*:18450", "decode": "tcp://*:18452"}
    assert cache_plan.KV_EVENTS_FLAG not in stack._spec("reference").argv


def test_the_shared_part_alone_starts_none_of_the_stacks_servers() -> None:
    assert cache.stack_parts({"multi-turn", "short"}) == ()
    assert cache.stack_parts({"short"}) == cache.STACK_PARTS
    assert cache.stack_parts(set()) == cache.STACK_PARTS


# --- caches holding every prefix: the kit against a client pinning each prefix ------------------
def test_held_requests_repeat_each_prefix_with_suffixes_of_their_own() -> None:
    plan = cache_plan.CachePlan(prefixes=3, per_prefix=4, prefix_len=32, suffix_len=8)
    first, second = cache_plan.held_requests(plan, 0), cache_plan.held_requests(plan, 1)
    assert first == cache_plan.held_requests(plan, 0)  # seeded
    assert sorted(i for i, _ in first) == [0] * 4 + [1] * 4 + [2] * 4
    assert all(ids[:32] == cache_plan.held_prefix(plan, i) for i, ids in first + second)
    suffixes = [tuple(ids[32:]) for _, ids in first + second]
    assert len(set(suffixes)) == len(suffixes) == 24 and all(len(s) == 8 for s in suffixes)
    assert [i for i, _ in first] != sorted(i for i, _ in first)  # shuffled
    assert cache_plan.held_ideal(plan, 16) == 3 * 4 * 32


def _held(arm: str, ttfts: list[float], hits: float) -> dict[str, Any]:
    grown = {"vllm:prefix_cache_hits_total": hits / 2, "vllm:request_success_total": 2}
    return {"arm": arm, "round": 1, "ttft_s": ttfts,
            "decodes": {"decode-a": grown, "decode-b": grown}}  # fmt: skip


@pytest.mark.parametrize(
    ("kit_ttft", "kit_hits", "met"),
    [(0.034, 2048, True), (0.036, 2048, False), (0.032, 1024, False)],
)
def test_held_goal_wants_the_pinning_clients_ttft_within_5_ms_and_its_hits(
    kit_ttft: float, kit_hits: float, met: bool
) -> None:
    runs = [_held("pinned", [0.030, 0.029, 0.031, 0.030], 2048),
            _held("kit", [kit_ttft] * 4, kit_hits)]  # fmt: skip
    rows = cache_report.held_rows(runs, 2048)
    assert [r["arm"] for r in rows] == ["kit", "pinned"]
    assert rows[1]["ttft_ms"] == pytest.approx(30.0) and rows[1]["hit_fraction"] == 1.0
    goal = cache_report.held_goal(rows)
    assert goal.met is met and goal.value == pytest.approx(kit_ttft * 1000 - 30.0)
    assert "client pinning each prefix | 4 | 30.0" in cache_report.format_held(rows, PLAN)
    assert cache_report.held_goal([]).met is None


HELD_URLS = {"decode-a": "http://a", "decode-b": "http://b", "proxy-events": "http://proxy"}


def fake_held_servers(
    monkeypatch: pytest.MonkeyPatch, rounds: int
) -> tuple[cache_plan.CachePlan, list[tuple[Any, ...]]]:
    """A small plan of ``rounds`` and ``run_held``'s servers faked; every call in order:
    ``("ttft", url, prompt ids)``, ``("reset", url)``, ``("wait", url, blocks)``."""
    plan = cache_plan.CachePlan(prefixes=4, per_prefix=2, prefix_len=32, suffix_len=8,
                                shared_rounds=rounds)  # fmt: skip
    calls: list[tuple[Any, ...]] = []
    lock = threading.Lock()

    def fake_ttft(url: str, body: dict[str, Any]) -> float:
        with lock:
            calls.append(("ttft", url, list(body["prompt"])))
        return 0.01

    monkeypatch.setattr(cache, "ttft_s", fake_ttft)
    monkeypatch.setattr(cache, "reset_prefix_cache", lambda url: calls.append(("reset", url)))
    monkeypatch.setattr(cache, "snapshot", lambda sources: {k: {} for k in sources})
    monkeypatch.setattr(cache.time, "sleep", lambda s: None)
    monkeypatch.setattr(cache, "wait_for_events", lambda url, n: calls.append(("wait", url, n)))
    return plan, calls


def test_run_held_warms_each_prefix_on_its_holder_and_pins_only_the_pinning_client(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plan, calls = fake_held_servers(monkeypatch, rounds=1)
    runs = cache.run_held(HELD_URLS, "m", plan, 16)
    sent = [(c[1], c[2]) for c in calls if c[0] == "ttft"]
    waits = [(c[1], c[2]) for c in calls if c[0] == "wait"]
    assert waits == [("http://proxy", 4 * 2)] * 2  # 4 prefixes of 2 blocks, before each run
    assert [r["arm"] for r in runs] == ["kit", "pinned"]
    holder = {tuple(cache_plan.held_prefix(plan, i)): ("http://a", "http://b")[i % 2]
              for i in range(4)}  # fmt: skip
    per_arm = 4 + 8  # the warm-up, then the requests
    for arm, batch in zip(("kit", "pinned"), (sent[:per_arm], sent[per_arm:]), strict=True):
        assert all(url == holder[tuple(ids)] for url, ids in batch[:4])  # warm-up on holders
        want = [
            holder[tuple(ids[:32])] if arm == "pinned" else "http://proxy" for _, ids in batch[4:]
        ]
        assert [url for url, _ in batch[4:]] == want and len(want) == 8


def test_waiting_for_events_ends_when_the_index_holds_the_warm_up(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    held = iter([0.0, 4.0, 8.0])
    pages: list[str] = []

    def fake_scrape(url: str, source: str, wanted: Any) -> Any:
        pages.append(url)
        return Scrape({}, {cache.CACHE_BLOCKS: {cache.EVENTS_BLOCKS: next(held)}}, {})

    monkeypatch.setattr(cache, "scrape", fake_scrape)
    monkeypatch.setattr(cache.time, "sleep", lambda s: None)
    cache.wait_for_events("http://proxy", 8)
    assert pages == ["http://proxy"] * 3 and not caplog.records
    cache.wait_for_events("http://proxy", 8, timeout_s=0.0)  # never enough: a warning, no hang
    assert "fewer than 8 blocks from KV events" in caplog.text


def test_the_full_cache_part_warms_nothing_and_restarts_the_proxy_before_each_kit_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plan, calls = fake_held_servers(monkeypatch, rounds=2)
    runs = cache.run_held(HELD_URLS, "m", plan, 16, fresh=lambda: calls.append(("fresh",)))
    events = [" ".join(c[:2]) if c[0] != "ttft" else c[1] for c in calls]
    assert [(r["arm"], r["round"]) for r in runs] == [
        ("kit", 1), ("pinned", 1), ("pinned", 2), ("kit", 2)]  # fmt: skip
    assert not [c for c in calls if c[0] == "wait"]  # no warm-up to wait for
    runs_at = [i for i, e in enumerate(events) if e == "reset http://a"]
    first = events[runs_at[0] : runs_at[0] + 4]
    assert first == ["reset http://a", "reset http://b", "fresh", "http://proxy"]
    assert events.count("fresh") == 2 and events.count("http://proxy") == 16


def _full(arm: str, rnd: int, hits: float, a: int, b: int) -> dict[str, Any]:
    def grown(n: int) -> dict[str, float]:
        return {"vllm:prefix_cache_hits_total": hits * n / (a + b),
                "vllm:request_success_total": n}  # fmt: skip

    return {"arm": arm, "round": rnd, "ttft_s": [0.02] * (a + b),
            "decodes": {"decode-a": grown(a), "decode-b": grown(b)}}  # fmt: skip


@pytest.mark.parametrize(
    ("kit_hits", "kit_split", "hits_met", "spread_met"),
    [
        (1000, (12, 12), True, True),
        (995, (14, 10), True, True),  # 0.995 of the pinning client's: within 0.01 of ideal
        (980, (12, 12), False, True),  # a run 0.02 short of the pinning client
        (1100, (20, 4), True, False),  # more hits, but one decode took 83%
    ],
)
def test_full_cache_goals_compare_each_run_with_the_pinning_client_and_cap_one_decodes_share(
    kit_hits: float, kit_split: tuple[int, int], hits_met: bool, spread_met: bool
) -> None:
    runs = [_full("pinned", 1, 1000, 12, 12), _full("kit", 1, 1000, 12, 12),
            _full("kit", 2, kit_hits, *kit_split), _full("pinned", 2, 1000, 12, 12)]  # fmt: skip
    rows = cache_report.full_rows(runs, 1000)
    assert [r["largest_share"] for r in rows[:2]] == [0.5, 0.5]
    hits, spread = cache_report.full_goals(rows)
    assert (hits.met, spread.met) == (hits_met, spread_met)
    assert "2/2 runs within" in hits.measured if hits_met else "1/2 runs within" in hits.measured
    text = cache_report.format_full(rows, PLAN)
    assert "client pinning each prefix" in text and "| 2 | pd-proxy, cache-aware (events)" in text
    assert [g.met for g in cache_report.full_goals([])] == [None, None]


def test_the_full_cache_part_renders_its_rows_and_goals() -> None:
    data = {"plan": PLAN.as_dict(), "errors": [],
            "full": [_full("kit", 1, 64, 5, 3), _full("pinned", 1, 64, 4, 4)]}  # fmt: skip
    outcome = cache.render(data, PLAN, 16)
    assert "Full caches" in outcome.table and "largest share" in outcome.table
    assert "full caches: no decode gets > 60% of the requests (kit)" in outcome.table
    assert len(outcome.summary["full_rows"]) == 2


def test_the_decodes_max_model_len_is_a_flag_checked_against_the_kv_blocks() -> None:
    parser = argparse.ArgumentParser()
    cache.add_arguments(parser)
    flags = "--kv-blocks 44 --max-model-len 688 --prefixes 24 --prefix-len 600 --skip short"
    args = parser.parse_args(flags.split())
    assert cache.plan_from_args(args).shared_max_model_len == 688 and cache.check(args) is None
    args.max_model_len = 704  # 44 blocks less vLLM's null block x 16 = 688 tokens: refused
    assert "below the decodes' --max-model-len 704" in (cache.check(args) or "")
