"""The admit stage on its own: admitted now, queued then admitted when room comes back, refused
at once past the bounds, and every part of a lease given back once."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from pd_proxy.admission.fair_queue import Flow
from pd_proxy.admission.gate import Gate, Refused, Settings
from pd_proxy.admission.lease import Lease
from pd_proxy.admission.metrics import AdmissionMetrics
from pd_proxy.admission.room import Limits
from pd_proxy.backends.pool import BackendPool
from pd_proxy.backends.route import LOCAL, PD, Route

P, D = "http://p:1", "http://d:1"
PD_ROUTE, LOCAL_ROUTE = Route(PD, "test"), Route(LOCAL, "test")
DEFAULT_LIMITS = Limits(prefill_requests=1, decode_requests=8, pending_pulls=2)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def gate(
    limits: Limits = DEFAULT_LIMITS,
    queue_size: int = 4,
    queue_timeout: float = 5.0,
    clock: Clock | None = None,
    prefills: tuple[str, ...] = (P,),
) -> Gate:
    settings = Settings(limits, queue_size, queue_timeout, retry_503_s=5.0)
    pools = BackendPool("prefill", prefills), BackendPool("decode", (D,))
    return Gate(settings, *pools, AdmissionMetrics(CollectorRegistry()), clock or Clock())


async def settle() -> None:
    """Let woken waiters run (a result set by the gate reaches its task a few steps later)."""
    for _ in range(10):
        await asyncio.sleep(0)


def outcome(g: Gate, outcome: str, reason: str) -> float:
    return g.metrics.outcomes.labels(outcome, reason)._value.get()


async def test_room_admits_at_once_and_settles_the_replicas() -> None:
    g = gate()
    route, lease = await g.admit(PD_ROUTE, Flow("a"), 100)
    assert route.prefill is not None and route.prefill.url == P
    assert route.decode is not None and route.decode.url == D
    assert (g.room.of(P).requests, g.room.of(P).tokens, g.room.of(D).pulls) == (1, 100, 1)
    lease.release()
    assert (g.room.of(P).requests, g.room.of(P).tokens, g.room.of(D).requests) == (0, 0, 0)
    assert g.room.of(D).pulls == 0 and outcome(g, "admitted", "now") == 1


async def test_a_queued_request_goes_when_the_prefill_answers() -> None:
    g = gate()
    _, first = await g.admit(PD_ROUTE, Flow("a"), 100)
    waiting = asyncio.create_task(g.admit(PD_ROUTE, Flow("a"), 100))
    await asyncio.sleep(0)
    assert not waiting.done() and len(g.queue) == 1
    first.prefill_done()  # the prefill's room goes back; the KV now waits for decode
    _, second = await asyncio.wait_for(waiting, 1)
    assert g.room.of(D).pulls == 2 and outcome(g, "admitted", "queued") == 1
    first.decode_started()
    assert g.room.of(D).pulls == 1
    for lease in (first, second):
        lease.release()
        lease.release()  # a second release gives nothing back twice
    assert g.room.of(D).requests == 0 and g.room.of(P).requests == 0


async def test_decode_that_has_not_pulled_stops_new_prefill_legs() -> None:
    """Two KV hand-overs wait for the decode (the cap): a third P/D request waits although the
    prefill is free; decode-alone requests still go."""
    g = gate(Limits(prefill_requests=4, decode_requests=8, pending_pulls=2))
    leases = [(await g.admit(PD_ROUTE, Flow("a"), 10))[1] for _ in range(2)]
    for lease in leases:
        lease.prefill_done()
    third = asyncio.create_task(g.admit(PD_ROUTE, Flow("a"), 10))
    await asyncio.sleep(0)
    assert not third.done()
    _, local = await asyncio.wait_for(g.admit(LOCAL_ROUTE, Flow("b"), 10), 1)
    leases[0].decode_started()
    _, lease = await asyncio.wait_for(third, 1)
    for each in (*leases, lease, local):
        each.release()


async def test_each_flow_gets_its_share_of_a_full_queue() -> None:
    """queue_size 4: one flow may fill it alone, but a second flow still gets a place and the
    first loses its right to more."""
    g = gate(queue_size=4)
    _, holder = await g.admit(PD_ROUTE, Flow("flood"), 10)
    flood = [asyncio.create_task(g.admit(PD_ROUTE, Flow("flood"), 10)) for _ in range(4)]
    await asyncio.sleep(0)
    with pytest.raises(Refused) as full:
        await g.admit(PD_ROUTE, Flow("flood"), 10)
    assert full.value.status == 429 and full.value.code == "queue_full"
    assert full.value.retry_after >= 1
    light = asyncio.create_task(g.admit(PD_ROUTE, Flow("light"), 10))
    await asyncio.sleep(0)
    assert not light.done() and len(g.queue) == 5  # the new flow got its place
    holder.release()  # the flood's oldest goes, then the light flow's turn comes
    await settle()
    assert sum(t.done() for t in flood) == 1 and not light.done()
    next(t for t in flood if t.done()).result()[1].release()
    _, lease = await asyncio.wait_for(light, 1)  # before the other three of the flood
    assert sum(t.done() for t in flood) == 1
    lease.release()
    for task in flood:
        task.cancel()
    done = await asyncio.gather(*flood, return_exceptions=True)
    for result in done:
        if isinstance(result, tuple):
            result[1].release()
    assert len(g.queue) == 0


async def test_a_wait_predicted_past_the_timeout_is_refused_at_once() -> None:
    clock = Clock()
    g = gate(queue_size=100, queue_timeout=5.0, clock=clock)
    for second in range(5):  # served: 100 tokens a second
        g.rate.begin(float(second))
        g.rate.end(float(second + 1), 100)
    _, holder = await g.admit(PD_ROUTE, Flow("a"), 100)
    queued = [asyncio.create_task(g.admit(PD_ROUTE, Flow("a"), 100)) for _ in range(5)]
    await settle()
    assert len(g.queue) == 5  # the fifth: 400 queued + half of 100 in flight = 4.5 s ahead
    with pytest.raises(Refused) as late:  # 500 + 50 tokens at 100 a second: 5.5 s
        await g.admit(PD_ROUTE, Flow("a"), 100)
    assert late.value.code == "queue_wait" and late.value.retry_after == 6
    holder.release()
    for task in queued:
        task.cancel()
    await asyncio.gather(*queued, return_exceptions=True)


async def test_a_wait_that_runs_out_is_a_429() -> None:
    g = gate(queue_timeout=0.05)
    _, holder = await g.admit(PD_ROUTE, Flow("a"), 10)
    with pytest.raises(Refused) as late:
        await g.admit(PD_ROUTE, Flow("a"), 10)
    assert late.value.code == "queue_timeout" and len(g.queue) == 0
    holder.release()


async def test_a_client_that_leaves_the_queue_takes_no_room() -> None:
    g = gate()
    _, holder = await g.admit(PD_ROUTE, Flow("a"), 10)
    waiting = asyncio.create_task(g.admit(PD_ROUTE, Flow("a"), 10))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert len(g.queue) == 0 and outcome(g, "left", "client_gone") == 1
    holder.release()
    assert g.room.of(P).requests == 0 and g.room.of(D).requests == 0


async def test_no_healthy_replica_is_a_503_before_any_queueing() -> None:
    g = gate()
    g.pools["prefill"].backends[0].healthy = False
    with pytest.raises(Refused) as down:
        await g.admit(PD_ROUTE, Flow("a"), 10)
    assert down.value.status == 503 and down.value.retry_after == 5
    route, lease = await g.admit(LOCAL_ROUTE, Flow("a"), 10)  # decode alone needs no prefill
    assert route.prefill is None
    lease.release()


async def test_the_route_s_chosen_replica_is_waited_for() -> None:
    """A cache-aware route names the prefill holding the prompt: the request waits for it even
    though the other prefill is free."""
    other = "http://p:2"
    g = gate(prefills=(P, other))
    holder_backend = g.pools["prefill"].backends[0]
    pinned = Route(PD, "cache", prefill=holder_backend)
    _, first = await g.admit(pinned, Flow("a"), 10)
    waiting = asyncio.create_task(g.admit(pinned, Flow("a"), 10))
    free_route, free = await g.admit(PD_ROUTE, Flow("b"), 10)
    assert free_route.prefill is not None and free_route.prefill.url == other
    await asyncio.sleep(0)
    assert not waiting.done()
    first.release()
    route, lease = await asyncio.wait_for(waiting, 1)
    assert route.prefill is holder_backend
    for each in (free, lease):
        each.release()


async def test_room_given_back_admits_the_waiter_from_the_loop_once() -> None:
    """The releasing request's own stack runs none of the gate: the waiter is placed on the
    loop's next turn, and two releases in one turn wake the queue once."""
    g = gate(limits=Limits(prefill_requests=1, decode_requests=1))
    _, holder = await g.admit(PD_ROUTE, Flow("a"), 10)
    assert not hasattr(holder, "__dict__")  # slots: no per-request dict on the hot path
    waiting = asyncio.create_task(g.admit(PD_ROUTE, Flow("b"), 10))
    await asyncio.sleep(0)
    runs = []
    dispatch = g.wake._dispatch
    g.wake._dispatch = lambda: (runs.append(len(g.queue)), dispatch())[1]
    holder.prefill_done()
    holder.release()
    assert runs == [] and len(g.queue) == 1  # nothing placed on the releasing stack
    await asyncio.sleep(0)
    assert runs == [1] and len(g.queue) == 0  # one dispatch for both, and the waiter placed
    _, lease = await asyncio.wait_for(waiting, 1)
    lease.release()
    await settle()
    assert runs == [1]  # nobody waits: no wake-up scheduled
    assert isinstance(lease, Lease)


async def test_the_rate_is_timed_by_the_leases_and_idle_time_is_left_out() -> None:
    """P/D: from admission to the prefill's answer; decode alone: to the decode's first byte."""
    clock = Clock()
    g = gate(clock=clock)
    for i, route in enumerate((PD_ROUTE, LOCAL_ROUTE) * 2):
        clock.now = 10.0 * i  # a request every 10 s, each prompt served in 0.5 s
        _, lease = await g.admit(route, Flow("a"), 100)
        clock.now += 0.5
        lease.prefill_done()
        lease.decode_started()
        clock.now += 3.0  # decoding: not the prompt's time
        lease.release()
    assert g.rate.per_second() == 200.0


async def test_every_flow_seen_has_its_series_even_when_it_never_queued() -> None:
    registry = CollectorRegistry()
    settings = Settings(DEFAULT_LIMITS, 4, 5.0, retry_503_s=5.0)
    pools = BackendPool("prefill", (P,)), BackendPool("decode", (D,))
    g = Gate(settings, *pools, AdmissionMetrics(registry), Clock())
    _, lease = await g.admit(PD_ROUTE, Flow("team-a"), 10)
    lease.release()
    labels = {"flow": "team-a"}
    assert registry.get_sample_value("pd_proxy_queue_depth", labels) == 0
    assert registry.get_sample_value("pd_proxy_queue_wait_seconds_count", labels) == 1
    assert registry.get_sample_value("pd_proxy_queue_wait_seconds_sum", labels) == 0
