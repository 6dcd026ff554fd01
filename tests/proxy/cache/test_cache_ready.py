"""Ready only when it knows: with KV events, the proxy's readiness waits until every healthy
replica's publishers were looked up and each was replayed or sent a first batch, for at most
``--cache-ready-timeout``; then it serves anyway and says so. Decided once."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from pd_proxy.backends.pool import BackendPool
from pd_proxy.routing.cache.follow import CacheFollower
from pd_proxy.routing.cache.metrics import CacheMetrics

P, D0, D1 = "http://p:1", "http://d0:1", "http://d1:1"


def follower(timeout: float, events: bool = True) -> tuple[CacheFollower, CollectorRegistry]:
    registry = CollectorRegistry()
    pools = (BackendPool("prefill", (P,)), BackendPool("decode", (D0, D1)))
    known = CacheFollower(
        pools,
        events_on=events,
        approx_on=False,
        approx_blocks=10,
        backend_key=None,
        health_timeout=1.0,
        metrics=CacheMetrics(registry),
        ready_timeout=timeout,
    )
    return known, registry


def sub(caught_up: bool) -> SimpleNamespace:
    return SimpleNamespace(caught_up=caught_up)


def test_not_ready_until_every_publisher_is_replayed_or_heard() -> None:
    known, registry = follower(30.0)
    assert known.not_ready() is not None  # not following yet
    known._started = time.monotonic()
    assert all(url in (known.not_ready() or "") for url in (P, D0, D1))  # none looked up
    known.no_events[P] = 0.0  # the prefill publishes no events: nothing to wait for
    known.subs[D0] = [sub(True)]
    known.subs[D1] = [sub(True), sub(False)]  # a DP engine behind
    waiting = known.not_ready()
    assert waiting is not None and D1 in waiting and D0 not in waiting and P not in waiting
    assert registry.get_sample_value("pd_proxy_cache_ready") == 0
    known.subs[D1][1].caught_up = True
    assert known.not_ready() is None
    assert registry.get_sample_value("pd_proxy_cache_ready") == 1
    assert registry.get_sample_value("pd_proxy_cache_ready_timeouts_total") == 0
    known.subs[D1] = [sub(False)]  # re-subscribed later: still ready
    assert known.not_ready() is None


def test_a_replica_down_is_not_waited_for() -> None:
    known, _ = follower(30.0)
    known._started = time.monotonic()
    for pool in known.pools:
        for b in pool.backends:
            b.healthy = b.url == D0
    known.subs[D0] = [sub(True)]
    assert known.not_ready() is None


def test_after_the_bounded_wait_it_serves_anyway_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    known, registry = follower(0.5)
    known._started = time.monotonic() - 1.0
    with caplog.at_level(logging.WARNING, logger="pd_proxy.cache"):
        assert known.not_ready() is None
    assert "serving without knowing their caches" in caplog.text and D0 in caplog.text
    assert registry.get_sample_value("pd_proxy_cache_ready_timeouts_total") == 1
    assert registry.get_sample_value("pd_proxy_cache_ready") == 0


@pytest.mark.parametrize(("timeout", "events"), [(0.0, True), (30.0, False)])
def test_no_wait_asked_or_no_events_is_ready_at_once(timeout: float, events: bool) -> None:
    known, registry = follower(timeout, events)
    assert known.not_ready() is None
    assert registry.get_sample_value("pd_proxy_cache_ready") == 1


class FakeSubscription:
    """What the readiness reads of a subscription, and its close."""

    def __init__(self, caught_up: bool) -> None:
        self.caught_up = caught_up

    async def close(self) -> None:
        pass


async def test_health_is_503_until_the_cache_index_knows() -> None:
    """Through the real app: a decode whose publisher has not been replayed or heard keeps
    /health (the readiness probe) at 503 with the reason; once caught up, 200."""
    import json

    from tests.proxy.proxy_harness import pd_stack

    async with pd_stack(decodes=2, prefix_cache_routing="events", cache_ready_timeout=60.0) as s:
        known = s.running.pipeline.planner.cache.known
        waiting = FakeSubscription(caught_up=False)
        known.ready = False
        known.subs[s.decodes[0].url] = [waiting]
        known.no_events.pop(s.decodes[0].url, None)
        for pool in known.pools:  # the others publish no events (the fakes answer 404)
            for b in pool.backends:
                if b.url != s.decodes[0].url:
                    known.no_events.setdefault(b.url, 0.0)
        status, raw = await s.get("/health")
        assert status == 503, raw
        message = json.loads(raw)["error"]["message"]
        assert "cache index is not ready" in message and s.decodes[0].url in message
        waiting.caught_up = True
        status, raw = await s.get("/health")
        assert status == 200, raw
