"""pd_proxy.scheduler, the one place a replica is chosen: filter, score, pick, on a snapshot."""

from __future__ import annotations

from pd_proxy import scheduler
from pd_proxy.backends.pool import Backend, BackendPool
from pd_proxy.scheduler import Snapshot, choose


def backends(*outstanding: int) -> tuple[Backend, ...]:
    out = []
    for i, n in enumerate(outstanding):
        b = Backend("decode", f"http://d{i}:1")
        b.outstanding = n
        out.append(b)
    return tuple(out)


def test_least_outstanding_ties_go_to_the_rotation() -> None:
    a, b, c = backends(1, 0, 0)
    choice = choose(Snapshot((a, b, c), rotation=0))
    assert choice is not None and choice.backend is b and choice.rotation == 2
    choice = choose(Snapshot((a, b, c), rotation=2))
    assert choice is not None and choice.backend is c and choice.rotation == 0


def test_the_filter_drops_unhealthy_excluded_and_roomless_and_keeps_busy_probing_last() -> None:
    a, b, c = backends(0, 0, 1)
    a.healthy = False
    assert choose(Snapshot((a, b, c)), exclude=b).backend is c
    assert choose(Snapshot((a, b, c)), among={c}).backend is c
    c.probing = True
    assert choose(Snapshot((a, b, c))).backend is b
    assert choose(Snapshot((a, b, c)), exclude=b).backend is c
    b.healthy = c.healthy = False
    assert choose(Snapshot((a, b, c))) is None


def test_a_scored_choice_wins_and_leaves_the_rotation() -> None:
    a, b = backends(0, 5)
    choice = choose(Snapshot((a, b), rotation=1), scored=b)
    assert choice is not None and choice.backend is b and choice.rotation is None


def test_pick_place_and_least_busy_on_a_pool() -> None:
    pool = BackendPool("decode", ("http://a:1", "http://b:1"))
    a, b = pool.backends
    assert [scheduler.pick(pool) for _ in range(3)] == [a, b, a]
    b.outstanding = 3
    assert scheduler.least_busy(pool) is a and pool.rotation == 1  # the rotation stays
    assert scheduler.place(pool, None, lambda x: x is b) is b  # only b has room
    assert scheduler.place(pool, a, lambda x: x is b) is None  # the plan's a waits for room
    assert scheduler.place(pool, None, lambda x: False) is None
