"""Thousands of client keys (one flow each, behind a gateway): the queue keeps no state for a
flow once it can no longer matter, and admission's series stop at ``--max-flow-labels`` flows,
the rest under ``other``, a flow idle for long giving its label up."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from pd_proxy.admission.fair_queue import FairQueue, Ticket
from pd_proxy.admission.metrics import FLOW_LABEL_IDLE_S, OTHER, AdmissionMetrics


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_ten_thousand_flows_leave_no_state_behind() -> None:
    """A busy band (one flow always queued) serving 10,000 keys of one request each: the flows
    the virtual time passed are swept, so the state stays near the flows with tickets."""
    q = FairQueue()
    q.push(Ticket("steady", 10))
    for n in range(10_000):
        q.push(Ticket(f"key-{n}", 10))
        q.push(Ticket("steady", 10))
        assert q.pop(lambda t: True) is not None
        assert q.pop(lambda t: True) is not None
        assert q.flows() <= 200, n
    while q.pop(lambda t: True) is not None:
        pass
    assert q.flows() == 0 and len(q) == 0


def test_flow_labels_are_capped_with_an_other_bucket() -> None:
    registry = CollectorRegistry()
    metrics = AdmissionMetrics(registry, max_flow_labels=3, clock=Clock())
    labels = [metrics.flow(f"key-{n}") for n in range(10)]
    assert labels == ["key-0", "key-1", "key-2"] + [OTHER] * 7
    for label in labels[3:]:  # seven flows waiting under one label: the depth adds them up
        metrics.enter(label)
    metrics.exit(OTHER)
    assert registry.get_sample_value("pd_proxy_queue_depth", {"flow": OTHER}) == 6
    flows = {
        sample.labels["flow"]
        for family in registry.collect()
        if family.name == "pd_proxy_queue_depth"
        for sample in family.samples
    }
    assert flows == {"key-0", "key-1", "key-2", OTHER}


def test_an_idle_flow_gives_its_label_up_to_a_new_one() -> None:
    clock = Clock()
    registry = CollectorRegistry()
    metrics = AdmissionMetrics(registry, max_flow_labels=2, clock=clock)
    assert metrics.flow("a") == "a" and metrics.flow("b") == "b"
    metrics.enter("b")  # b has a request waiting: its label stays, however long
    clock.now = FLOW_LABEL_IDLE_S / 2
    assert metrics.flow("a") == "a"  # a is used again: not idle
    clock.now = FLOW_LABEL_IDLE_S * 1.4
    assert metrics.flow("c") == OTHER  # neither a (used at 0.5) nor b (waiting) is idle
    clock.now = FLOW_LABEL_IDLE_S * 1.7
    assert metrics.flow("c") == "c"  # a was idle past the limit: its label went to c
    assert registry.get_sample_value("pd_proxy_queue_depth", {"flow": "a"}) is None
    assert registry.get_sample_value("pd_proxy_queue_depth", {"flow": "b"}) == 1


def test_the_next_ticket_is_found_without_looking_at_every_flow() -> None:
    """10,000 flows waiting: choosing the next one asks ``fits`` of the few heads in finish
    order until one fits, not of every flow's head."""
    q = FairQueue()
    for n in range(10_000):
        q.push(Ticket(f"key-{n}", 10 + n % 7))
    asked: list[str] = []

    def fits(t: Ticket) -> bool:
        asked.append(t.flow)
        return len(asked) % 3 == 0  # two heads in three wait for a full replica

    order = [q.pop(fits) for _ in range(100)]
    assert all(t is not None for t in order) and len(asked) <= 300
