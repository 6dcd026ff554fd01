"""The admission queue: strict priority between bands, then fair shares of tokens between the
flows of a band (start-time fair queuing, Goyal et al.). Pure: no clock, no I/O.

Each ticket gets a virtual start and finish tag: a flow's tickets follow one another at
``cost / weight`` apart, and a flow that was idle starts at the queue's virtual time (the start
tag of the last ticket served), so it neither banks credit while idle nor waits behind another
flow's backlog. The ticket with the smallest finish tag among those that fit goes next. Over time
each waiting flow gets tokens in proportion to its weight, whatever the size or number of its
requests: a flood of long prompts from one key cannot starve another key's short ones, which
wait about one of the flood's requests.

A flow's state outlives its last ticket only while its finish tag is ahead of the virtual time
(it would still start its next ticket there); then it is dropped, at the latest by a sweep each
time the band's flows double, so thousands of keys each sending a few requests leave nothing
behind. The choice of the next ticket reads a heap of the flows' head tickets by finish tag
(stale entries skipped as they come up), so it costs a few heap steps, not one look per flow.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Flow:
    """Who is asking: the flow's name, its weight among the flows of its band, and the band
    (lower is served first)."""

    name: str
    weight: float = 1.0
    band: int = 0


@dataclass(eq=False)
class Ticket:
    """One queued request: its flow, band (lower first), weight, cost in tokens and what it
    needs (``need``: opaque to the queue, read by the ``fits`` test)."""

    flow: str
    cost: int
    band: int = 0
    weight: float = 1.0
    need: Any = None
    arrived: float = 0.0
    start: float = field(default=0.0, repr=False)  # virtual tags, set by the queue
    finish: float = field(default=0.0, repr=False)
    seq: int = field(default=0, repr=False)  # arrival order: ties go to the earlier


class _Flow:
    __slots__ = ("last", "tickets")

    def __init__(self) -> None:
        self.tickets: deque[Ticket] = deque()
        self.last = 0.0  # finish tag of its last ticket


SWEEP_MIN = 64  # idle flows a band keeps before its first sweep


class _Band:
    def __init__(self) -> None:
        self.flows: dict[str, _Flow] = {}  # every flow with state: tickets, or credit ahead
        self.active: dict[str, _Flow] = {}  # the flows with tickets
        self.vtime = 0.0  # start tag of the last ticket served
        self.sweep_at = SWEEP_MIN  # flows past which the idle ones are swept
        # (finish, seq, ticket) of each flow's head; an entry whose ticket is no longer its
        # flow's head, or whose tags moved, is stale and skipped.
        self.heads: list[tuple[float, int, Ticket]] = []

    def head(self, flow: _Flow) -> None:
        """``flow``'s first ticket is new at the head (or its tags moved): enter it."""
        if flow.tickets:
            t = flow.tickets[0]
            heapq.heappush(self.heads, (t.finish, t.seq, t))

    def current(self, entry: tuple[float, int, Ticket]) -> bool:
        finish, _, t = entry
        flow = self.flows.get(t.flow)
        return (
            flow is not None and bool(flow.tickets) and flow.tickets[0] is t and t.finish == finish
        )

    def sweep(self) -> None:
        """Drop the idle flows the virtual time has passed (amortised: at most once each time
        the flows double)."""
        if len(self.flows) < self.sweep_at:
            return
        vtime = self.vtime
        self.flows = {n: f for n, f in self.flows.items() if f.tickets or f.last > vtime}
        self.sweep_at = max(SWEEP_MIN, 2 * len(self.flows))


class FairQueue:
    def __init__(self) -> None:
        self._bands: dict[int, _Band] = {}
        self._size = 0
        self._seq = itertools.count()

    def __len__(self) -> int:
        return self._size

    def push(self, ticket: Ticket) -> None:
        band = self._bands.setdefault(ticket.band, _Band())
        flow = band.flows.get(ticket.flow)
        if flow is None:
            band.sweep()
            flow = band.flows[ticket.flow] = _Flow()
        band.active[ticket.flow] = flow
        start = flow.last if flow.tickets else max(flow.last, band.vtime)
        ticket.start = start
        ticket.finish = flow.last = start + ticket.cost / ticket.weight
        ticket.seq = next(self._seq)
        flow.tickets.append(ticket)
        if len(flow.tickets) == 1:
            band.head(flow)
        self._size += 1

    def remove(self, ticket: Ticket) -> bool:
        """Take ``ticket`` out (its client left, or its wait ran out); False if not queued. The
        flow's later tickets move up by its share, so leaving costs the flow nothing."""
        band = self._bands.get(ticket.band)
        flow = None if band is None else band.flows.get(ticket.flow)
        if flow is None or ticket not in flow.tickets:
            return False
        assert band is not None
        was_head = flow.tickets[0] is ticket
        flow.tickets.remove(ticket)
        self._size -= 1
        shift = ticket.cost / ticket.weight
        for later in flow.tickets:
            if later.seq > ticket.seq:
                later.start -= shift
                later.finish -= shift
        flow.last -= shift
        if was_head:
            band.head(flow)
        self._forget_if_idle(band, ticket)
        return True

    def depth(self, flow: str) -> int:
        return sum(len(b.flows[flow].tickets) for b in self._bands.values() if flow in b.flows)

    def depths(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for band in self._bands.values():
            for name, flow in band.active.items():
                out[name] = out.get(name, 0) + len(flow.tickets)
        return out

    def flows(self) -> int:
        """Flows the queue keeps state for (with tickets, or credit ahead of the virtual time)."""
        return sum(len(b.flows) for b in self._bands.values())

    def pop(self, fits: Callable[[Ticket], bool]) -> Ticket | None:
        """The next ticket to admit among the heads that ``fits``, or None. Bands go strictly in
        order; a band whose heads all wait for full replicas lets the next band go."""
        for number in sorted(self._bands):
            band = self._bands[number]
            waiting: list[tuple[float, int, Ticket]] = []  # heads that do not fit now
            ticket = None
            while band.heads:
                entry = heapq.heappop(band.heads)
                if not band.current(entry):
                    continue
                if fits(entry[2]):
                    ticket = entry[2]
                    break
                waiting.append(entry)
            for entry in waiting:
                heapq.heappush(band.heads, entry)
            if ticket is None:
                continue
            flow = band.flows[ticket.flow]
            flow.tickets.popleft()
            band.head(flow)
            band.vtime = max(band.vtime, ticket.start)
            self._size -= 1
            self._forget_if_idle(band, ticket)
            return ticket
        return None

    def cost_ahead(self, flow: str, band: int, cost: int, weight: float = 1.0) -> int:
        """Tokens served before a new ticket of ``flow`` if nothing else arrived: every lower
        band, and in its band every ticket whose finish tag comes first."""
        ahead = sum(
            t.cost
            for n, b in self._bands.items()
            if n < band
            for f in b.active.values()
            for t in f.tickets
        )
        same = self._bands.get(band)
        if same is None:
            return ahead
        own = same.flows.get(flow)
        if own is not None and own.tickets:
            start = own.last
        else:
            start = max(same.vtime, own.last if own is not None else 0.0)
        finish = start + cost / weight
        return ahead + sum(
            t.cost for f in same.active.values() for t in f.tickets if t.finish <= finish
        )

    def _forget_if_idle(self, band: _Band, ticket: Ticket) -> None:
        """An idle flow's entry goes once the queue's virtual time has passed its last tag (it
        can no longer matter); an empty band goes and starts again from zero."""
        flow = band.flows.get(ticket.flow)
        if flow is not None and not flow.tickets:
            band.active.pop(ticket.flow, None)
            if flow.last <= band.vtime:
                del band.flows[ticket.flow]
        if not band.active:
            del self._bands[ticket.band]
