"""`bench overload`'s pure parts: the key file, a mode's figures from fixed replies, the goals and
the table; and its options, checked before anything starts."""

from __future__ import annotations

import argparse

import pytest

from pcp_pd_kit.bench import kinds, overload
from pcp_pd_kit.bench.overload_report import (
    FLOOD,
    LIGHT,
    Reply,
    format_table,
    goals,
    key_file_text,
    kv_growth,
    percentile,
    summarize,
)
from pd_proxy.config.key_files import read_key_file

KV_FREED = {"held": 3.0, "freed": 3.0, "usage": 0.0}


def served(client: str, seconds: float) -> Reply:
    return Reply(client, 200, seconds, complete=True)


def refused(client: str, code: str, seconds: float = 0.01, status: int = 429) -> Reply:
    return Reply(client, status, seconds, code, retry_after="3")


REPLIES = [
    served(FLOOD, 1.0),
    served(FLOOD, 2.0),
    served(FLOOD, 9.0),
    refused(FLOOD, "queue_full"),
    refused(FLOOD, "queue_full"),
    refused(FLOOD, "queue_wait"),
    served(LIGHT, 0.4),
    served(LIGHT, 0.2),
    served(LIGHT, 0.3),
]


def test_the_key_file_names_each_flow_and_the_proxy_reads_it(tmp_path) -> None:
    path = tmp_path / "keys"
    path.write_text(key_file_text({FLOOD: "sk-a", LIGHT: "sk-b"}))
    entries = read_key_file(str(path))
    assert [(e.key, e.flow) for e in entries] == [("sk-a", FLOOD), ("sk-b", LIGHT)]


def test_percentile_is_the_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 11)], 90) == 9.0
    assert percentile([5.0], 90) == 5.0


def test_a_mode_counts_served_and_refused_by_code_and_times_the_served() -> None:
    s = summarize(REPLIES, [0.1, 0.1, 0.2], KV_FREED)
    assert (s["requests"], s["served"], s["errors"]) == (9, 6, 0)
    assert s["refused"] == {"429 queue_full": 2, "429 queue_wait": 1}
    assert s["by_client"][LIGHT] == {"served": 3}
    assert s["ttft_s"] == {"p50": 0.4, "p90": 9.0, "max": 9.0}
    assert s["light_ttft_s"] == 0.3 and s["light_alone_s"] == 0.1
    assert s["light_ratio"] == pytest.approx(3.0)
    assert s["kv_all_freed"] and s["refusals_without_retry_after"] == 0


def test_a_cut_stream_a_5xx_and_no_answer_are_errors_not_refusals() -> None:
    replies = [Reply(FLOOD, 200, 1.0), Reply(FLOOD, 504, 300.0, "timeout"), Reply(LIGHT, 0, 5.0)]
    s = summarize(replies, [0.1], KV_FREED)
    assert (s["served"], s["errors"], s["refused"]) == (0, 3, {})
    assert [r.outcome for r in replies] == ["200 cut", "504 timeout", "0 no answer"]
    assert s["ttft_s"]["p50"] is None and s["light_ratio"] is None


def test_kv_growth_is_the_counters_delta_and_usage_after() -> None:
    got = kv_growth(
        {"held": 10.0, "freed": 9.0, "usage": 0.1}, {"held": 30.0, "freed": 30.0, "usage": 0.0}
    )
    assert got == {"held": 20.0, "freed": 21.0, "usage": 0.0}
    assert kv_growth({}, {"held": None, "freed": 4.0, "usage": None})["held"] is None
    kept = summarize(REPLIES, [0.1], {"held": 5.0, "freed": 4.0, "usage": 0.0})
    assert not kept["kv_all_freed"]
    assert not summarize(REPLIES, [0.1], {"held": 5.0, "freed": 5.0, "usage": 0.02})["kv_all_freed"]


def test_goals_are_met_by_a_good_run_and_each_missed_by_its_fault() -> None:
    good = summarize(REPLIES, [0.1, 0.1, 0.2], KV_FREED)
    assert all(g.ok for g in goals(good))
    slow = summarize([*REPLIES, served(FLOOD, 91.0)], [0.1], KV_FREED)
    late = summarize([*REPLIES, refused(FLOOD, "queue_timeout", 60.0)], [0.1], KV_FREED)
    light_refused = summarize([*REPLIES, refused(LIGHT, "queue_full")], [0.1], KV_FREED)
    no_header = summarize([*REPLIES, Reply(FLOOD, 429, 0.1, "queue_full")], [0.1], KV_FREED)
    missed = {
        name: [g.name for g in goals(s) if not g.ok]
        for name, s in {
            "slow": slow,
            "late": late,
            "light": light_refused,
            "hdr": no_header,
        }.items()
    }
    assert missed["slow"] == ["some served, none waited over 90 s"]
    assert missed["late"] == ["refusals 429/503 with Retry-After within 2 s"]
    assert missed["light"] == ["light client never refused, median TTFT <= 5x alone"]
    assert missed["hdr"] == ["refusals 429/503 with Retry-After within 2 s"]


def test_the_table_has_both_modes_and_the_goals() -> None:
    s = summarize(REPLIES, [0.1, 0.1, 0.2], KV_FREED)
    plan = {"flood_prompts": 6, "flood_input_len": 1000, "light_requests": 3,
            "light_input_len": 64, "output_len": 16}  # fmt: skip
    text = format_table({"admission": s, "no-admission": s}, plan)
    assert "| admission | 6/9 | 429 queue_full: 2, 429 queue_wait: 1 | 0 | 0.40 | 9.00 |" in text
    assert "| no-admission | 6/9 |" in text
    assert "3.00x" in text and "held 3.00, freed 3.00, usage 0.0" in text
    assert "- [met] the prefill's KV freed" in text


def test_the_kind_is_registered_and_checks_its_sizes() -> None:
    assert kinds.KINDS["overload"] == "pcp_pd_kit.bench.overload"
    parser = argparse.ArgumentParser()
    overload.add_arguments(parser)
    args = parser.parse_args([])
    assert (args.flood_prompts, args.flood_input_len, args.light_requests) == (48, 1000, 5)
    assert overload.check(args) is None
    bad = parser.parse_args(["--flood-prompts", "0", "--output-len", "0"])
    assert overload.check(bad) == "--flood-prompts 0, --output-len 0: at least 1"
    assert "--port-base" in str(overload.check(parser.parse_args(["--port-base", "65500"])))


def test_beside_a_flood_the_light_client_sends_until_it_ends_and_only_those_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A light client stuck behind the flood waits on one request; the fast ones it sends once
    the flood is over must not hide that wait in its median."""
    import threading

    over = threading.Event()
    sent: list[int] = []

    def fake_send(url: str, key: str, client: str, body: object, timeout_s: float) -> Reply:
        sent.append(1)
        if len(sent) == 4:  # the flood ends while the fourth request waits
            over.set()
        return Reply(client, 200, 60.0 if len(sent) <= 4 else 0.1, complete=True)

    monkeypatch.setattr(overload, "send", fake_send)
    args = argparse.Namespace(
        light_requests=2, light_input_len=4, output_len=2, request_timeout_s=1.0
    )
    replies = overload.light_run("http://x:1", "k", "m", 0, args, over)
    assert [r.during for r in replies] == [True, True, True, True]  # past --light-requests
    later = overload.light_run("http://x:1", "k", "m", 0, args, over)
    assert [r.during for r in later] == [False, False]  # the flood is over: at least 2, after
    s = summarize([*replies, *later], [0.1], KV_FREED)
    assert s["light_ttft_s"] == 60.0 and s["light_during"] == 4 and s["light_ttft_max_s"] == 60.0
