"""The admission queue's order: bands strictly, then deficit round robin over flows by tokens."""

from __future__ import annotations

import pytest

from pd_proxy.admission.fair_queue import FairQueue, Ticket


def drain(queue: FairQueue, fits=lambda t: True) -> list[str]:
    order = []
    while (t := queue.pop(fits)) is not None:
        order.append(f"{t.flow}{t.cost}")
    return order


def test_one_flow_is_first_in_first_out() -> None:
    q = FairQueue()
    for cost in (5, 1, 3):
        q.push(Ticket("a", cost))
    assert drain(q) == ["a5", "a1", "a3"] and len(q) == 0


def test_a_flood_cannot_starve_a_trickle() -> None:
    """Ten queued requests of one flow, then one of another: the other's goes second."""
    q = FairQueue()
    for _ in range(10):
        q.push(Ticket("flood", 100))
    q.push(Ticket("light", 100))
    assert drain(q)[:2] == ["flood100", "light100"]


def test_shares_are_by_tokens_not_requests() -> None:
    """A flow of long prompts and a flow of short ones get about equal tokens, so the short
    flow's requests go several per long one."""
    q = FairQueue()
    for _ in range(4):
        q.push(Ticket("long", 400))
    for _ in range(8):
        q.push(Ticket("short", 100))
    order = drain(q)
    first_five = order[:5]
    assert first_five.count("short100") == 4 and first_five.count("long400") == 1, order


def test_weights_give_proportional_shares() -> None:
    q = FairQueue()
    for _ in range(6):
        q.push(Ticket("heavy", 10, weight=2.0))
        q.push(Ticket("light", 10, weight=1.0))
    first_six = drain(q)[:6]
    assert first_six.count("heavy10") == 4 and first_six.count("light10") == 2, first_six


def test_a_lower_band_goes_first_whatever_its_arrival() -> None:
    q = FairQueue()
    q.push(Ticket("batch", 10, band=1))
    q.push(Ticket("batch", 10, band=1))
    q.push(Ticket("urgent", 10, band=0))
    assert drain(q) == ["urgent10", "batch10", "batch10"]


def test_a_head_that_does_not_fit_lets_the_next_flow_go() -> None:
    """Flow a waits for a full replica; flow b's request needs another one and goes."""
    q = FairQueue()
    q.push(Ticket("a", 5, need="full"))
    q.push(Ticket("b", 5, need="free"))
    taken = q.pop(lambda t: t.need == "free")
    assert taken is not None and taken.flow == "b"
    assert q.pop(lambda t: t.need == "free") is None and len(q) == 1


def test_a_removed_ticket_is_never_served() -> None:
    q = FairQueue()
    gone, stays = Ticket("a", 1), Ticket("a", 2)
    q.push(gone)
    q.push(stays)
    assert q.remove(gone) and not q.remove(gone)
    assert drain(q) == ["a2"] and q.depths() == {}


@pytest.mark.parametrize(
    ("queued", "new", "ahead"),
    [
        ({}, ("a", 10), 0),  # nothing waits
        ({"a": [10, 10]}, ("a", 10), 20),  # its own queue first
        ({"b": [10] * 10}, ("a", 10), 10),  # another flow's flood: about one equal share
        ({"b": [5]}, ("a", 10), 5),  # less than a share: all of it
    ],
)
def test_cost_ahead_counts_the_fair_order(
    queued: dict[str, list[int]], new: tuple[str, int], ahead: int
) -> None:
    q = FairQueue()
    for flow, costs in queued.items():
        for cost in costs:
            q.push(Ticket(flow, cost))
    assert q.cost_ahead(new[0], 0, new[1]) == ahead
