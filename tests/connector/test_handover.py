"""The per-request handover breakdown: events to phases (pure), and through vLLM's stats path to
the ``vllm:nixl_handover_seconds`` histogram."""

from __future__ import annotations

import pytest

from pcp_nixl_connector import handover as h
from pcp_nixl_connector.metric_names import HANDOVER_SECONDS, KV_LEASE_SECONDS

DECODE = [
    ("r1", h.ADMITTED, 10.0),
    ("r1", h.READ_POSTED, 10.004),
    ("r1", h.TRANSFER_DONE, 10.010),
    ("r1", h.SCHEDULER_SEEN, 10.013),
    ("r1", h.FIRST_TOKEN, 10.050),
]


def _by_phase(done: list[tuple[str, float]]) -> dict[str, float]:
    return {phase: round(seconds, 6) for phase, seconds in done}


def test_a_decode_request_yields_every_phase_once_its_first_token_is_in() -> None:
    tracker = h.HandoverTracker()
    assert tracker.add(DECODE[:4], now=10.02) == []  # nothing until the first token
    assert _by_phase(tracker.add(DECODE[4:], now=10.06)) == {
        "admitted_to_read_posted": 0.004,
        "read_posted_to_transfer_done": 0.006,
        "transfer_done_to_scheduler": 0.003,
        "scheduler_to_first_token": 0.037,
        "admitted_to_first_token": 0.05,
    }
    assert len(tracker) == 0  # nothing kept after completion


def test_events_arrive_out_of_order_and_twice_across_steps_and_ranks() -> None:
    tracker = h.HandoverTracker()
    shuffled = [DECODE[2], DECODE[0], DECODE[1], ("r1", h.TRANSFER_DONE, 10.5), DECODE[3]]
    assert tracker.add(shuffled, now=10.1) == []
    phases = _by_phase(tracker.add([DECODE[4]], now=10.1))
    assert phases["read_posted_to_transfer_done"] == 0.006  # the first stamp counts


def test_prefill_hold_and_a_request_with_missing_events() -> None:
    tracker = h.HandoverTracker()
    done = tracker.add([("p", h.PREFILL_DONE, 5.0), ("p", h.BLOCKS_FREED, 5.25)], now=6)
    assert _by_phase(done) == {"prefill_kv_hold": 0.25}
    # A request admitted but never posted (e.g. a full local prefix hit): only what is known.
    done = tracker.add([("q", h.ADMITTED, 1.0), ("q", h.FIRST_TOKEN, 1.2)], now=2)
    assert _by_phase(done) == {"admitted_to_first_token": 0.2}


def test_requests_that_never_finish_are_dropped_after_max_age() -> None:
    tracker = h.HandoverTracker(max_age_s=60)
    tracker.add([("lost", h.ADMITTED, 100.0)], now=100)
    tracker.add([("other", h.ADMITTED, 150.0)], now=150)
    assert len(tracker) == 2
    tracker.add([], now=170)
    assert len(tracker) == 1  # "lost" is 70 s old


@pytest.mark.vllm
def test_events_through_stats_aggregation_reach_the_histogram(tiny_model_dir) -> None:
    from pcp_nixl_connector.stats import PcpNixlKVConnectorStats
    from tests.connector.test_stats import _build_prom, _config

    scheduler, worker = PcpNixlKVConnectorStats(), PcpNixlKVConnectorStats()
    assert scheduler.is_empty()
    scheduler.record_handover([DECODE[0], DECODE[3], DECODE[4]])
    worker.record_handover([DECODE[1], DECODE[2]])
    assert not scheduler.is_empty()
    merged = worker.aggregate(scheduler)
    prom, text_of = _build_prom(_config(tiny_model_dir, extra={"kv_lease_duration": 45}))
    text = text_of()
    assert f'{KV_LEASE_SECONDS}{{engine="0",model_name="m"}} 45.0' in text
    for phase in h.PHASES:  # every phase's series exists before any traffic
        assert f'{HANDOVER_SECONDS}_count{{engine="0",model_name="m",phase="{phase}"}} 0.0' in text
    # As the API server receives it: a dict whose tuples may have become lists.
    payload = {
        k: [list(e) for e in v] if k == "kit_handover_events" else v for k, v in merged.data.items()
    }
    prom.observe(payload, engine_idx=0)
    text = text_of()
    count = f'{HANDOVER_SECONDS}_count{{engine="0",model_name="m",phase="%s"}} 1.0'
    assert count % "admitted_to_first_token" in text
    assert count % "read_posted_to_transfer_done" in text
    assert (
        f'{HANDOVER_SECONDS}_sum{{engine="0",model_name="m",phase="admitted_to_first_token"}} 0.05'
        in text
    )
