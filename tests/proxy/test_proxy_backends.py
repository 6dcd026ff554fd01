"""Several backends per role: spreading, skipping the dead, retrying a refused prefill once."""

from __future__ import annotations

import json
import socket

import aiohttp
from aiohttp import web

from pd_proxy import scheduler
from pd_proxy.api.app import RUNNING_KEY, build_app, make_runner
from pd_proxy.backends.pool import BackendPool
from pd_proxy.config import ProxyConfig
from pd_proxy.testing.fake_model import DECODE
from pd_proxy.testing.fake_vllm import FakeVLLM
from tests.proxy.proxy_harness import pd_stack


def test_pool_prefers_least_outstanding_and_rotates_ties():
    pool = BackendPool("decode", ("http://a:1", "http://b:1", "http://c:1"))
    a, b, c = pool.backends
    assert [scheduler.pick(pool).url for _ in range(4)] == [a.url, b.url, c.url, a.url]
    a.outstanding, b.outstanding, c.outstanding = 3, 1, 2
    assert scheduler.pick(pool) is b
    b.healthy = False
    assert scheduler.pick(pool) is c
    assert scheduler.pick(pool, exclude=c) is a
    a.healthy = c.healthy = False
    assert scheduler.pick(pool) is None


async def test_requests_succeed_and_spread_with_one_backend_of_each_role_down():
    async with pd_stack(prefills=2, decodes=2, dead_prefills=1, dead_decodes=1) as s:
        status, raw = await s.get("/health")
        assert status == 200  # degraded but serving
        health = json.loads(raw)
        assert sorted(health["down"]) == sorted(s.dead)
        assert health["prefill"][s.dead[0]] is False
        for i in range(20):
            stream = i % 2 == 0
            status, _, raw = await s.post(
                "/v1/completions", {"prompt": "x", "max_tokens": 2, "stream": stream}
            )
            assert status == 200, raw
        assert [len(f.seen) for f in s.prefills] == [10, 10]
        assert [len(f.seen) for f in s.decodes] == [10, 10]
        for dead in s.dead:
            role = "prefill" if dead in health["prefill"] else "decode"
            assert s.sample("pd_proxy_backend_healthy", {"role": role, "backend": dead}) == 0


async def test_refused_prefill_is_retried_once_on_another():
    async with pd_stack(prefills=1, dead_prefills=1, decodes=1) as s:
        s.revive_dead()  # the dead one looks healthy, as if it died after its last check
        for _ in range(4):
            status, _, raw = await s.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
            assert status == 200, raw
        assert len(s.prefill.seen) == 4
        labels = {"stage": "prefill", "backend": s.dead[0]}
        assert s.sample("pd_proxy_backend_errors_total", labels) == 1  # then it was skipped


async def test_refused_decode_before_any_byte_is_retried_on_another():
    async with pd_stack(decodes=1, dead_decodes=1) as s:
        s.revive_dead()
        for _ in range(4):
            status, _, raw = await s.post(
                "/v1/completions", {"prompt": "x", "max_tokens": 2, "stream": True}
            )
            assert status == 200, raw
        assert len(s.decode.seen) == 4


async def test_health_checks_take_backends_out_and_back():
    async with pd_stack(prefills=2, decodes=1, health_interval=0.05) as s:
        sick, well = s.prefills
        checker = s.running.checker
        sick.knobs.healthy = False
        await _rounds(checker, 2)
        status, raw = await s.get("/health")
        assert status == 200 and json.loads(raw)["down"] == [sick.url]
        for _ in range(4):
            status, _, _ = await s.post("/v1/completions", {"prompt": "x", "max_tokens": 1})
            assert status == 200
        assert len(sick.seen) == 0 and len(well.seen) == 4

        well.knobs.healthy = False
        await _rounds(checker, 2)
        status, raw = await s.get("/health")
        assert status == 503 and sorted(json.loads(raw)["down"]) == sorted([sick.url, well.url])
        status, _, _ = await s.post("/v1/completions", {"prompt": "x"})
        assert status == 503

        sick.knobs.healthy = well.knobs.healthy = True
        await _rounds(checker, 2)
        status, _ = await s.get("/health")
        assert status == 200
        labels = {"role": "prefill", "backend": sick.url}
        assert s.sample("pd_proxy_backend_healthy", labels) == 1


async def _rounds(checker, n: int) -> None:
    """Wait for ``n`` more complete health rounds (the first may have started before a change)."""
    import asyncio

    target = checker.rounds + n
    while checker.rounds < target:
        await asyncio.sleep(0.01)


async def test_health_is_truthful_from_the_first_request():
    """The first check round runs before the proxy listens: no optimistic 200 for a hung backend.

    The prefill accepts connections but never answers, so its check takes the whole timeout;
    a proxy that served before the round ended would still call it healthy.
    """
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen()
        hung_url = f"http://127.0.0.1:{hung.getsockname()[1]}"
        decode = FakeVLLM(role=DECODE)
        await decode.start()
        config = ProxyConfig(
            prefill=(hung_url,), decode=(decode.url,), health_timeout=1.0, health_interval=30.0
        )
        runner = make_runner(build_app(config), config)
        try:
            await runner.setup()
            assert runner.app[RUNNING_KEY].checker.rounds == 1
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            host, port = runner.addresses[0][:2]
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://{host}:{port}/health") as r:
                    status, body = r.status, await r.json()
        finally:
            await runner.cleanup()
            await decode.stop()
    assert status == 503
    assert body["down"] == [hung_url]


async def test_a_slow_health_check_on_a_busy_backend_is_not_a_death():
    """vLLM answers /health from the loop that serves tokens: on a saturated host a check can time
    out mid-prefill. A backend with requests in flight stays through BUSY_TIMEOUTS_TOLERATED such
    checks and is down at the next; an idle one is down at once; an answer resets the count; a
    refused connection is down at once however busy."""
    from pd_proxy.backends.breaker import BUSY_TIMEOUTS_TOLERATED
    from pd_proxy.backends.health import HealthChecker

    results: list[tuple[str, bool]] = []
    with socket.socket() as hung, socket.socket() as closed:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        hung_url = f"http://127.0.0.1:{hung.getsockname()[1]}"
        refused_url = f"http://127.0.0.1:{closed.getsockname()[1]}"
        live = FakeVLLM(role=DECODE)
        await live.start()
        busy, idle, refused = BackendPool(
            "prefill", (hung_url, hung_url + "/idle", refused_url)
        ).backends
        answering = BackendPool("decode", (live.url,)).backends[0]
        try:
            async with aiohttp.ClientSession() as session:
                checker = HealthChecker(
                    [], session, 30.0, 0.2, lambda b, ok: results.append((b.url, ok))
                )
                busy.outstanding = refused.outstanding = answering.outstanding = 1
                for _ in range(BUSY_TIMEOUTS_TOLERATED):
                    await checker.check_some([busy, idle, refused])
                    assert (busy.healthy, idle.healthy, refused.healthy) == (True, False, False)
                await checker.check_some([busy])
                assert not busy.healthy
                # An answer in between resets the streak.
                answering.slow_checks = BUSY_TIMEOUTS_TOLERATED
                await checker.check_some([answering])
                assert (answering.healthy, answering.slow_checks) == (True, 0)
        finally:
            await live.stop()
    assert (busy.url, False) in results and (refused.url, False) in results
