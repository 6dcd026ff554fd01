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
    for second in range(5):
        rate.done(float(second), 1000)
    assert rate.per_second() == 1000.0
    assert rate.wait(5000) == 5.0
