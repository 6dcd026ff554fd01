"""The events index's table of vLLM hash -> key (pd_proxy.routing.cache.table): the C part's
``BlockTable`` pd-proxy uses and the ``DictTable`` fallback, each driven by the same random
operations beside a plain dict (a dict keeps the order of storing, which the bound evicts by).
Neither is skipped: the bootstrap fails where the C part does not build."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from pd_proxy.routing.cache import table
from pd_proxy.routing.cache._chain import BlockTable
from pd_proxy.routing.cache.index import ReplicaIndex
from pd_proxy.routing.cache.table import DictTable, Table

IMPLEMENTATIONS: dict[str, Callable[[], Table]] = {"c": BlockTable, "python": DictTable}


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def make(request: pytest.FixtureRequest) -> Callable[[], Table]:
    return IMPLEMENTATIONS[request.param]


def test_pd_proxy_uses_the_c_table() -> None:
    assert table.NATIVE
    assert type(ReplicaIndex().by_hash) is BlockTable


def _same(t: Table, model: dict[int, int]) -> None:
    assert len(t) == len(model)
    assert list(t.values()) == list(model.values())
    assert t.oldest(len(model) + 3) == list(model)
    n = len(model) // 3
    assert t.oldest(n) == list(model)[:n]


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_match_a_dict(make: Callable[[], Table], seed: int) -> None:
    """Stores, updates, removals anywhere, evictions from the front and clears, many enough
    that the C table grows, compacts its holes and rebuilds its index many times over."""
    rng = random.Random(seed)
    t, model = make(), {}
    span = rng.choice([50, 2_000, 1 << 60])  # few hashes (many updates) or all distinct
    for step in range(20_000):
        op = rng.random()
        if op < 0.5:
            h, key = rng.randrange(span), rng.randrange(1 << 60)
            t[h] = key
            model[h] = key  # an update keeps its place
        elif op < 0.7 and model:
            h = rng.choice(list(model)) if len(model) < 64 else next(iter(model))
            assert t.pop(h) == model.pop(h)
        elif op < 0.8 and model:
            for h in t.oldest(rng.randint(1, 5)):  # the bound: from the front
                assert t.pop(h) == model.pop(h)
        elif op < 0.95:
            h = rng.randrange(span)
            assert (h in t) == (h in model)
            assert t.get(h) == model.get(h)
            assert t.pop(h, None) == model.pop(h, None)
        elif op < 0.952:
            t.clear()
            model.clear()
        if step % 997 == 0:
            _same(t, model)
    _same(t, model)


def test_removing_everything_then_storing_again(make: Callable[[], Table]) -> None:
    t = make()
    for round_ in range(3):
        for h in range(5_000):
            t[h * 7 + round_] = h
        assert t.oldest(2) == [round_, 7 + round_]
        for h in range(5_000):
            assert t.pop(h * 7 + round_) == h
        assert len(t) == 0 and t.oldest(4) == [] and list(t.values()) == []
        assert t.get(round_) is None and round_ not in t


def test_the_largest_ints_it_holds(make: Callable[[], Table]) -> None:
    t = make()
    top = (1 << 64) - 2
    t[top] = top
    t[0] = 0
    assert t.get(top) == top and t.oldest(2) == [top, 0] and list(t.values()) == [top, 0]


def test_the_c_table_refuses_what_it_cannot_hold() -> None:
    t = BlockTable()
    for bad in (-1, 1 << 64, (1 << 64) - 1):
        with pytest.raises(OverflowError):
            t[bad] = 1
        with pytest.raises(OverflowError):
            t[1] = bad
    with pytest.raises(TypeError):
        t["a"] = 1  # type: ignore[index]
    with pytest.raises(TypeError):
        t.get(1.5)  # type: ignore[arg-type]
    with pytest.raises(KeyError):
        t.pop(3)
    with pytest.raises(TypeError, match="takes 1 or 2 arguments"):
        t.pop()  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="takes 1 or 2 arguments"):
        t.get(1, 2, 3)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        BlockTable(1)  # type: ignore[call-arg]
    assert len(t) == 0


def test_the_c_table_gives_its_room_back() -> None:
    """Emptied down to a few entries, its arrays shrink: an index that once held a burst does
    not keep its memory."""
    t = BlockTable()
    for h in range(100_000):
        t[h] = h
    full = t.__sizeof__()
    for h in t.oldest(99_990):
        t.pop(h)
    for h in range(200_000, 200_100):  # storing again compacts the holes
        t[h] = h
    assert len(t) == 110
    assert t.__sizeof__() < full / 20
