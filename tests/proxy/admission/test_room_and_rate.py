"""Room per replica against the limits, and the served-token rate behind predicted waits."""

from __future__ import annotations

from pd_proxy.admission.rate import Rate
from pd_proxy.admission.room import Limits, Room


def test_an_idle_replica_takes_one_request_of_any_length() -> None:
    room = Room(Limits(prefill_requests=2, prefill_tokens=1000))
    assert room.prefill_fits("p", 50_000)
    room.of("p").requests, room.of("p").tokens = 1, 50_000
    assert not room.prefill_fits("p", 1)


def test_prefill_limits_requests_and_tokens() -> None:
    room = Room(Limits(prefill_requests=2, prefill_tokens=1000))
    use = room.of("p")
    use.requests, use.tokens = 1, 600
    assert room.prefill_fits("p", 400) and not room.prefill_fits("p", 401)
    use.requests = 2
    assert not room.prefill_fits("p", 1)


def test_pending_pulls_cap_only_p_d_requests() -> None:
    room = Room(Limits(decode_requests=10, pending_pulls=2))
    use = room.of("d")
    use.requests, use.pulls = 3, 2
    assert not room.decode_fits("d", pd=True)
    assert room.decode_fits("d", pd=False)  # decode alone pulls nothing
    use.requests = 10
    assert not room.decode_fits("d", pd=False)


def test_zero_means_no_limit() -> None:
    room = Room(Limits())
    use = room.of("d")
    use.requests, use.pulls = 10_000, 10_000
    assert room.decode_fits("d", pd=True) and room.prefill_fits("d", 10**9)


def test_the_rate_needs_a_few_completions_then_counts_tokens_per_second() -> None:
    rate = Rate()
    assert rate.wait(100) is None
    for second in range(5):  # back to back: each took one second
        rate.begin(float(second))
        rate.end(float(second + 1), 1000)
    assert rate.per_second() == 1000.0
    assert rate.wait(5000) == 5.0


def test_idle_time_between_requests_does_not_slow_the_rate() -> None:
    """A light client every 10 s, each prompt served in 0.5 s: 2,000 tokens a second, not 100."""
    rate = Rate()
    for i in range(5):
        start = 10.0 * i
        rate.begin(start)
        rate.end(start + 0.5, 1000)
    assert rate.per_second() == 2000.0


def test_concurrent_work_counts_the_busy_time_once() -> None:
    rate = Rate()
    for i in range(4):  # two at a time, both done 1 s after they began: 2 x 100 tokens a second
        rate.begin(float(i))
        rate.begin(float(i))
        rate.end(float(i) + 1, 100)
        rate.end(float(i) + 1, 100)
    assert rate.per_second() == 200.0


def test_abandoned_work_counts_its_time_but_no_tokens() -> None:
    rate = Rate()
    rate.begin(0.0)
    rate.begin(0.0)
    rate.end(1.0, None)  # gave up after a second of the server's time
    rate.end(2.0, 100)
    for second in range(2, 5):
        rate.begin(float(second))
        rate.end(float(second + 1), 100)
    # 400 tokens over 5 busy seconds: the abandoned second counts toward the next completion
    assert rate.per_second() == 80.0
