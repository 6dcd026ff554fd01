"""`bench scale`'s pure parts and its fake fleet's wire: KV-event batches byte for byte as vLLM's
own encoder writes them, the replay socket, the churn and fill workloads, /metrics read line by
line, each phase's figures and the goals with by how much a missed one missed; its options,
checked before anything starts."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from pcp_pd_kit.bench import kinds, scale_report
from pcp_pd_kit.bench.scale_report import (
    event_step,
    flow_row,
    format_table,
    goals,
    held_pairs,
    held_prefix,
    key_file,
    max_kept_rate,
    prompt,
    samples,
)
from pcp_pd_kit.cli import main
from pd_proxy.config.key_files import read_key_file
from pd_proxy.testing import kv_publisher as kv
from pd_proxy.testing.fake_fleet import Fleet, workload

METRICS = """# HELP pd_proxy_kv_events_total x
pd_proxy_kv_events_total{backend="http://a",kind="events"} 10.0
pd_proxy_kv_events_total{backend="http://b",kind="events"} 5.0
pd_proxy_kv_events_total{backend="http://a",kind="batches"} 2.0
pd_proxy_kv_events_lag_seconds{backend="http://a"} 0.25
pd_proxy_cache_blocks{backend="http://a",source="events"} 7.0
pd_proxy_cache_blocks{backend="http://a",source="approx"} 100.0
"""


def test_a_batch_is_byte_for_byte_what_vllms_encoder_writes() -> None:
    msgspec = pytest.importorskip("msgspec")
    events = pytest.importorskip("vllm.distributed.kv_events")
    tokens = list(range(40, 72))
    ours = kv.batch_payload(12.5, [kv.stored([11, 2**63 + 5], None, tokens, 16), kv.removed(7)])
    theirs = events.KVEventBatch(ts=12.5, data_parallel_rank=0, events=[
        events.BlockStored(block_hashes=[11, 2**63 + 5], parent_block_hash=None, token_ids=tokens,
                           block_size=16, lora_id=None, medium="GPU", lora_name=None, group_idx=0),
        events.BlockRemoved(block_hashes=[7], medium="GPU", group_idx=0),
    ])  # fmt: skip
    assert ours == msgspec.msgpack.Encoder().encode(theirs)
    assert kv.batch_payload(1.0, []) == msgspec.msgpack.Encoder().encode(
        events.KVEventBatch(ts=1.0, events=[], data_parallel_rank=0)
    )


@pytest.mark.parametrize("n", [0, 15, 16, 65535, 65536])
def test_the_array_header_is_msgpacks(n: int) -> None:
    assert kv.array_header(n) == msgpack.packb([None] * n)[: len(kv.array_header(n))]
    assert msgpack.unpackb(kv.array_header(n) + b"\xc0" * n) == [None] * n


def test_a_prompts_blocks_chain_from_the_root_alike_on_every_replica() -> None:
    tokens = list(range(100, 100 + 16 * 5 + 3))  # five whole blocks and a part
    one = [msgpack.unpackb(e) for e in kv.prompt_events(tokens, 16)]
    split = [msgpack.unpackb(e) for e in kv.prompt_events(tokens, 16, per_event=2)]
    assert (
        len(one) == 1 and len(one[0]["block_hashes"]) == 5 and one[0]["parent_block_hash"] is None
    )
    assert [len(e["block_hashes"]) for e in split] == [2, 2, 1]
    assert sum((e["block_hashes"] for e in split), []) == one[0]["block_hashes"]
    assert split[1]["parent_block_hash"] == split[0]["block_hashes"][-1]
    assert one[0]["token_ids"] == tokens[:80]


def test_the_publisher_streams_in_sequence_and_replays_its_buffer() -> None:
    ctx = zmq.Context()
    pub = kv.Publisher(ctx, buffer_steps=2)
    sub = ctx.socket(zmq.SUB)
    dealer = ctx.socket(zmq.DEALER)
    try:
        assert pub.config()["endpoint"] == f"tcp://[::ffff:127.0.0.1]:{pub.port}"
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(f"tcp://127.0.0.1:{pub.port}")
        time.sleep(0.3)  # a SUB socket misses what was sent before it joined
        for _ in range(3):
            pub.publish([kv.removed(1)], ts=5.0)
        topic, seq, payload = sub.recv_multipart()
        assert (topic, int.from_bytes(seq, "big")) == (b"kv", 0)
        assert msgpack.unpackb(payload)[0] == 5.0 and pub.events == 3
        dealer.connect(f"tcp://127.0.0.1:{pub.replay_port}")
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        assert pub.router.poll(5000)
        pub.serve_replays()
        got = [dealer.recv_multipart() for _ in range(3)]
        assert [int.from_bytes(f[2], "big", signed=True) for f in got] == [1, 2, -1]  # buffer of 2
        assert got[-1][1] == b"" and got[-1][2] == kv.END_SEQ
        pub.restart()
        assert (pub.seq, pub.events, len(pub.buffer)) == (0, 0, 0)
    finally:
        sub.close(0)
        dealer.close(0)
        pub.close()
        ctx.term()


def test_the_churn_holds_its_live_chains_and_parents_come_first() -> None:
    ring = [
        msgpack.unpackb(e) for e in workload.churn_ring(3, 16, chains=4, chain_blocks=3, live=2)
    ]
    held: set[int] = set()
    for _ in range(2):  # round and round
        for event in ring:
            (block,) = event["block_hashes"]
            if event["type"] == "BlockStored":
                assert event["parent_block_hash"] in held | {None}
                held.add(block)
            else:
                held.discard(block)
    assert len(held) == 2 * 3
    assert workload.take(list(range(5)), 3, 4) == ([3, 4, 0, 1], 2)


def test_fill_events_are_new_chained_blocks() -> None:
    events = [msgpack.unpackb(e) for e in workload.fill_events(2, 7, 100, 16, chain_blocks=64)]
    hashes = [h for e in events for h in e["block_hashes"]]
    assert len(hashes) == len(set(hashes)) == 100
    assert [len(e["block_hashes"]) for e in events] == [64, 36]
    assert events[1]["parent_block_hash"] is None  # a second chain starts at the root
    assert all(len(e["token_ids"]) == 16 * len(e["block_hashes"]) for e in events)


def test_prompts_share_their_held_prefix_and_the_keys_make_a_key_file(tmp_path: Path) -> None:
    a, b = prompt(1024, 0, 1, 16), prompt(1024, 0, 2, 16)
    held = held_prefix(1024, 0, 16)
    assert len(a) == len(b) == 1024 and len(held) == 896 and len(held) % 16 == 0
    assert a[:896] == b[:896] == held and a[896:] != b[896:]
    assert prompt(1024, 1, 1, 16)[:896] != held
    (tmp_path / "keys").write_text(key_file(["sk-a", "sk-b"]))
    assert [(e.key, e.flow) for e in read_key_file(str(tmp_path / "keys"))] == [
        ("sk-a", "flow-0"), ("sk-b", "flow-1")]  # fmt: skip


def test_metrics_are_read_line_by_line() -> None:
    assert samples(METRICS, scale_report.LAG) == [('{backend="http://a"}', 0.25)]
    assert scale_report.total(METRICS, scale_report.EVENTS_TOTAL, kind="events") == 15.0
    assert held_pairs(METRICS) == 7.0
    assert held_pairs('pd_proxy_cache_index_blocks{role="decode"} 9.0\n') == 9.0
    row = flow_row(10, 100, {"admission": 50.0, "no-admission": 40.0}, METRICS, 0)
    assert (row["series"], row["admission_us"]) == (6, 10.0)


def step(rate: float, applied: float, lag_s: float, gap_s: float, drained: bool = True) -> dict:
    return event_step(rate, 2.0, rate * 2, applied * 2, [lag_s] * 10, [gap_s] * 10, drained)


def test_a_step_keeps_up_when_it_applied_what_came_soon_enough_and_caught_up() -> None:
    assert step(10000, 9900, 0.01, 0.01)["keeps_up"]
    assert not step(10000, 9000, 0.01, 0.01)["keeps_up"]  # behind
    assert not step(10000, 10000, 0.2, 0.01)["keeps_up"]  # too stale
    assert not step(10000, 10000, 0.01, 0.01, drained=False)["keeps_up"]
    steps = [step(0, 0, 0, 0.01), step(10000, 10000, 0.01, 0.01), step(20000, 10000, 0.5, 0.01),
             step(40000, 40000, 0.01, 0.01)]  # fmt: skip
    assert max_kept_rate(steps) == 10000  # a slower step lagging ends it


def figures(added_ms: float, cpu_ratio: float, lag_s: float) -> dict:
    off = {"p50_ms": 1.0, "p99_ms": 2.0, "cpu_us": 100.0, "errors": 0}
    on = {"p50_ms": 1.0 + added_ms, "p99_ms": 2.5, "cpu_us": 100.0 * cpu_ratio, "errors": 0}
    flows = [flow_row(n, 100, {"admission": cpu, "no-admission": 100.0}, "x 1\n" * series, 0)
             for n, cpu, series in ((10, 120.0, 50), (10000, 130.0, 50))]  # fmt: skip
    return {"wall_s": 300.0, "problems": [],
            "routing": [scale_report.routing_row(32, 8192, off, on, 0.8),
                        scale_report.routing_row(1, 8192, off, off, 0.0)],
            "events": {"replicas": 32, "publishers": 64, "seconds": 2.0, "streams": 8,
                       "stream_tokens": 64, "max_kept_per_s": 40000.0,
                       "steps": [step(0, 0, 0, 0.010), step(40000, 40000, lag_s, 0.0105)]},
            "memory": {"pairs": 1000, "publishers": 16, "rss_before_mb": 50.0,
                       "rss_after_mb": 50.1, "bytes_per_pair": 104.9},
            "flows": flows}  # fmt: skip


def test_goals_are_met_or_missed_by_how_much() -> None:
    met = {g["goal"]: g for g in goals(figures(0.1, 1.2, 0.05))}
    assert all(g["met"] for k, g in met.items() if "bound" not in k), met
    missed = {g["goal"]: g for g in goals(figures(0.5, 2.0, 0.3))}
    added = next(g for k, g in missed.items() if k.startswith("routing adds"))
    assert added["met"] is False and added["measured"] == "0.50 ms, over by 0.20 ms"
    assert "(R=32, 8192 tokens)" in added["goal"]
    lag = next(g for k, g in missed.items() if "lag p99" in k)
    assert lag["met"] is False and "300 ms, over by 200 ms" in lag["measured"]
    bound = next(g for k, g in missed.items() if "bound" in k)
    assert bound["met"] is False and "no bound setting" in bound["measured"]
    assert all(g["met"] is None for g in goals({}) if "bound" not in g["goal"])


def test_the_table_has_every_phase_and_the_goals() -> None:
    text = format_table({**figures(0.1, 1.2, 0.05), "proxy_commit": "abc"})
    for needle in ("| 32 | 8192 |", "| 40000 |", "105 bytes per pair", "| 10000 | 100 |",
                   "committed at abc", "| met |", "| NOT MET |"):  # fmt: skip
        assert needle in text, needle


def test_the_table_puts_the_revision_before_beside_each_routing_row() -> None:
    """--before: that revision's added p50, CPU on and CPU ratio, measured in the same turns."""
    data = figures(0.1, 1.2, 0.05)
    old = {"p50_ms": 1.0, "p99_ms": 2.0, "cpu_us": 100.0, "errors": 0}
    slow = {"p50_ms": 1.7, "p99_ms": 2.5, "cpu_us": 190.0, "errors": 0}
    for row in data["routing"]:
        row["before"] = scale_report.routing_row(row["replicas"], row["tokens"], old, slow, None)
    text = format_table({**data, "before_commit": "beef"})
    assert "CPU x before" in text and "pd-proxy at beef in the same turns" in text
    row = next(line for line in text.splitlines() if line.startswith("| 32 | 8192 |"))
    assert row.endswith("| 0 | 0.70 | 190 | 1.90 |"), row
    assert "CPU x before" not in format_table(figures(0.1, 1.2, 0.05))


def test_the_bound_check_reads_the_gauge_and_the_evictions() -> None:
    text = ('pd_proxy_cache_index_blocks{role="decode"} 4096.0\n'
            'pd_proxy_cache_index_evicted_blocks_total{role="decode"} 4104.0\n'
            'pd_proxy_cache_index_evicted_blocks_total{role="prefill"} 4104.0\n')  # fmt: skip
    assert scale_report.bound_check(text, 4096, 8200, "--b")["ok"]
    assert not scale_report.bound_check(text, 4000, 8200, "--b")["ok"]
    assert not scale_report.bound_check("", 4096, 8200, "--b")["ok"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [(["--skip", "routing,nope"], "phases are routing"), (["--flows", "0"], "at least 1"),
     (["--prompt-tokens", "32"], "--prompt-tokens at least 64"),
     (["--before", "no-such-ref-xyz"], "--before no-such-ref-xyz: not a commit"),
     (["--proxy-ref", "0" * 40], "not a commit of this repository")],
)  # fmt: skip
def test_bad_options_fail_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    assert kinds.KINDS["scale"] == "pcp_pd_kit.bench.scale"
    assert main(["bench", "scale", *argv, "--results-dir", str(tmp_path)]) == 2
    assert needle in capsys.readouterr().err and list(tmp_path.iterdir()) == []


def test_the_fleet_names_publishers_the_proxy_follows_and_pumps_what_its_rate_owes() -> None:
    from pd_proxy.routing.cache.publishers import parse_sources

    fleet = Fleet(2, 16)
    try:
        first = fleet.publishers[0]
        found, problems = parse_sources(fleet.fakes[0].sources, "127.0.0.1")
        assert problems == [] and found[0].endpoint == f"tcp://127.0.0.1:{first.port}"
        assert found[0].replay == f"tcp://127.0.0.1:{first.replay_port}"
        assert fleet.chosen(1) == [0, 2] and fleet.do_store(list(range(40)), 1) == {"blocks": 2}
        assert [p.events for p in fleet.publishers] == [1, 0, 1, 0]
        fleet.do_pump(rate=1000, seconds=1.0, replicas=2)
        start = fleet.pump.last
        fleet._pump(start + 0.3)
        fleet._pump(start + 5.0)  # stalled past the end: the rest goes at once
        assert sum(p.events for p in fleet.publishers) == 2 + 1000 and fleet.pump.rate == 0
    finally:
        for publisher in fleet.publishers:
            publisher.close()
        fleet.ctx.term()


def test_the_fleets_control_binds_before_its_fakes_and_answers_503_until_they_serve(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The control port (chosen free by the bench) is bound before the fakes' 2R servers take
    ports of the kernel's choosing, so none of them can take it first; and `GET /fleet`, the
    bench's health check, answers 503 until every fake serves (their URLs are not known before)."""
    fleet = Fleet(2, 16)
    kind = type(fleet.fakes[0])
    original = kind.start
    seen: list[tuple[bool, int]] = []

    async def start(self, host: str, port: int) -> None:
        assert fleet._runner is not None
        seen.append((bool(fleet._runner.addresses), (await fleet._describe(None)).status))
        await original(self, host, port)

    monkeypatch.setattr(kind, "start", start)

    async def run() -> int:
        try:
            await fleet.start(0)
            return (await fleet._describe(None)).status
        finally:
            await fleet.stop()

    assert asyncio.run(run()) == 200
    assert seen == [(True, 503)] * 4
