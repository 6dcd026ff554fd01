"""The circuit breaker's rules (pd_proxy.backends.breaker) and how the pool and checker apply
them."""

from __future__ import annotations

import aiohttp
import pytest

from pd_proxy import scheduler
from pd_proxy.backends.breaker import BUSY_TIMEOUTS_TOLERATED, Breaker, CheckResult, Verdict, judge
from pd_proxy.backends.health import HealthChecker
from pd_proxy.backends.pool import Backend, BackendPool
from tests.support.net import unaccepting_port

OK, FAILED, TIMED_OUT = CheckResult.OK, CheckResult.FAILED, CheckResult.TIMED_OUT


def backend(outstanding: int = 0, healthy: bool = True) -> Backend:
    b = Backend("prefill", "http://p:1", healthy)
    b.outstanding = outstanding
    return b


def test_a_silent_backend_whose_requests_stopped_while_others_progress_is_hung():
    busy = backend(outstanding=3)
    assert judge(TIMED_OUT, busy, progressed=False, peers_progressed=True) is Verdict.FAIL
    assert judge(TIMED_OUT, busy, progressed=True, peers_progressed=True) is Verdict.BUSY


def test_a_whole_slow_role_is_busy_for_a_few_checks_then_down():
    b = backend(outstanding=1)
    breaker = Breaker()
    for _ in range(BUSY_TIMEOUTS_TOLERATED):
        verdict = judge(TIMED_OUT, b, progressed=False, peers_progressed=False)
        assert verdict is Verdict.BUSY
        breaker.apply(b, verdict)
    assert judge(TIMED_OUT, b, False, False) is Verdict.FAIL


@pytest.mark.parametrize(
    ("result", "outstanding"), [(FAILED, 5), (TIMED_OUT, 0)], ids=["refused-busy", "idle-silent"]
)
def test_failures_and_idle_silence_fail(result, outstanding):
    assert judge(result, backend(outstanding), True, True) is Verdict.FAIL


def test_breaker_needs_failures_in_a_row_and_probes_before_closing():
    b = backend()
    breaker = Breaker(failures=2, successes=2)
    assert not breaker.apply(b, Verdict.FAIL) and b.healthy
    assert not breaker.apply(b, Verdict.PASS) and b.healthy  # a pass resets the streak
    breaker.apply(b, Verdict.FAIL)
    assert breaker.apply(b, Verdict.FAIL) and not b.healthy
    assert breaker.apply(b, Verdict.PASS) and b.healthy and b.probing  # half-open
    assert breaker.apply(b, Verdict.FAIL) and not b.healthy  # a probe failing: open at once
    breaker.apply(b, Verdict.PASS)
    assert b.probing
    breaker.apply(b, Verdict.PASS)
    assert b.healthy and not b.probing  # closed


def test_a_probing_backend_takes_one_request_at_a_time_unless_it_is_the_only_one():
    pool = BackendPool("prefill", ("http://a:1", "http://b:1"))
    a, b = pool.backends
    b.probing = True
    b.outstanding = 1
    a.outstanding = 5
    assert scheduler.pick(pool) is a
    b.outstanding = 0
    assert scheduler.pick(pool) is b
    b.outstanding = 1
    a.healthy = False
    assert scheduler.pick(pool) is b


class _NoConnect:
    """A session whose every connect times out, as aiohttp reports it."""

    def get(self, *args, **kwargs):
        raise aiohttp.ConnectionTimeoutError("Connection timeout to host")


async def test_a_connect_timeout_is_a_failure_not_busy():
    checker = HealthChecker([], _NoConnect(), 30.0, 0.2, lambda b, ok: None)  # type: ignore[arg-type]
    b = backend(outstanding=2)
    assert await checker.check(b) is FAILED
    await checker.check_some([b])
    assert not b.healthy


async def test_a_backend_that_accepts_no_connection_is_down_however_busy():
    """A listener whose accept queue is full drops new SYNs: the connect itself hangs."""
    with unaccepting_port() as port:
        b = Backend("prefill", f"http://127.0.0.1:{port}")
        b.outstanding = 1
        async with aiohttp.ClientSession() as session:
            checker = HealthChecker([], session, 30.0, 0.4, lambda b, ok: None)
            result = await checker.check(b)
    assert result is FAILED


async def test_legs_stay_on_a_backend_taken_out_when_no_other_is_healthy():
    """A lone prefill that misses its checks while busy is taken out, but its legs keep waiting
    there: moving them would only turn them into errors."""
    import asyncio

    pool = BackendPool("prefill", ("http://a:1",))
    (lone,) = pool.backends
    lone.outstanding = 1
    leg = asyncio.ensure_future(asyncio.sleep(10))
    lone.waiters[leg] = False

    class _Silent:
        def get(self, *args, **kwargs):
            raise asyncio.TimeoutError

    checker = HealthChecker([pool], _Silent(), 30.0, 0.2, lambda b, ok: None)  # type: ignore[arg-type]
    for _ in range(BUSY_TIMEOUTS_TOLERATED + 1):
        await checker.check_some([lone])
    assert not lone.healthy
    await asyncio.sleep(0)
    assert not leg.cancelled() and lone.waiters[leg] is False
    leg.cancel()
