"""The admit stage: a request starts when its route has room, waits in the fair queue while it
has none, and is refused at once when waiting could not end in time.

Refusals come before any backend hears of the request:
- 503 when no healthy replica of a role the route needs is left (``Retry-After``: one health
  interval, when the checks may bring one back);
- 429 when the queue is full, or the flow holds its share of it (the bound divided among the
  flows waiting, so one flow's flood leaves room for the others), or the predicted wait (tokens
  queued ahead under the fair order, at the rate admitted work has been finishing) is past
  ``--queue-timeout``, or a queued request waited that long after all.

An admitted request holds a ``Lease`` on its room (pd_proxy.admission.lease), given back as its
legs go; room given back admits what waits, from the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pd_proxy import scheduler
from pd_proxy.admission.fair_queue import FairQueue, Flow, Ticket
from pd_proxy.admission.lease import Lease, Wakeup
from pd_proxy.admission.metrics import (
    ADMITTED,
    CLIENT_GONE,
    LEFT,
    NO_BACKEND,
    NOW,
    QUEUE_FULL,
    QUEUE_TIMEOUT,
    QUEUE_WAIT,
    QUEUED,
    REFUSED,
    AdmissionMetrics,
)
from pd_proxy.admission.rate import Rate
from pd_proxy.admission.room import Limits, Room
from pd_proxy.backends.pool import Backend, BackendPool
from pd_proxy.backends.route import PD, Route
from pd_proxy.protocol.errors import ProxyError

ROLES = ("prefill", "decode")


class Refused(ProxyError):
    """A request admission turned away: 429 or 503, with ``Retry-After`` seconds and a code."""

    def __init__(self, status: int, message: str, code: str, retry_after: float) -> None:
        super().__init__(status, message)
        self.code = code
        self.retry_after = max(1, math.ceil(min(retry_after, 3600)))


@dataclass(frozen=True)
class Settings:
    limits: Limits
    queue_size: int
    queue_timeout: float
    retry_503_s: float  # Retry-After of a 503: about when a health check may bring a replica


class Gate:
    def __init__(
        self,
        settings: Settings,
        prefill: BackendPool,
        decode: BackendPool,
        metrics: AdmissionMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.pools = {"prefill": prefill, "decode": decode}
        self.metrics = metrics
        self.clock = clock
        self.room = Room(settings.limits)
        self.queue = FairQueue()
        self.rate = Rate()
        self.wake = Wakeup(self.queue, self._dispatch)
        self._waiting: dict[Ticket, asyncio.Future[tuple[Route, Lease]]] = {}
        limits = settings.limits
        for role, kind, value in (
            ("prefill", "requests", limits.prefill_requests),
            ("prefill", "tokens", limits.prefill_tokens),
            ("decode", "requests", limits.decode_requests),
            ("decode", "pulls", limits.pending_pulls),
        ):
            metrics.limit.labels(role, kind).set(value)
        metrics.watch(self.room_rows)

    # --- the stage ---------------------------------------------------------------------------

    async def admit(self, route: Route, flow: Flow, tokens: int) -> tuple[Route, Lease]:
        """``route`` with its replicas settled and the lease on their room; ``Refused`` when it
        cannot be served in time. A cancelled wait (the client left) leaves the queue."""
        pd = route.path == PD
        tokens = max(1, tokens)
        label = self.metrics.flow(flow.name)
        if not len(self.queue):
            placed = self._place(route, tokens, pd)
            if placed is not None:  # placed on healthy replicas: the common case, checked first
                self.metrics.count(ADMITTED, NOW)
                self.metrics.waited(label, 0.0)
                return placed
        self._check_healthy(pd)
        self._check_bounds(flow, tokens)
        ticket = Ticket(flow.name, tokens, flow.band, flow.weight, (route, pd), self.clock())
        future: asyncio.Future[tuple[Route, Lease]] = asyncio.get_running_loop().create_future()
        self._waiting[ticket] = future
        self.queue.push(ticket)
        self.metrics.enter(label)
        self._dispatch()
        try:
            placed = await asyncio.wait_for(asyncio.shield(future), self.settings.queue_timeout)
        except asyncio.TimeoutError:
            self._leave(ticket, future)
            self.metrics.count(REFUSED, QUEUE_TIMEOUT)
            self._observe_wait(label, ticket)
            limit = self.settings.queue_timeout
            raise Refused(
                429,
                f"no room for this request within {limit:g}s (--queue-timeout); retry later",
                QUEUE_TIMEOUT,
                limit,
            ) from None
        except asyncio.CancelledError:
            self._leave(ticket, future)
            self.metrics.count(LEFT, CLIENT_GONE)
            self._observe_wait(label, ticket)
            raise
        finally:
            self.metrics.exit(label)
        self.metrics.count(ADMITTED, QUEUED)
        self._observe_wait(label, ticket)
        return placed

    # --- room ----------------------------------------------------------------------------------

    def _healthy(self, role: str) -> list[Backend]:
        return [b for b in self.pools[role].backends if b.healthy and not b.draining]

    def _check_healthy(self, pd: bool) -> None:
        for role in ROLES if pd else ("decode",):
            if not any(b.healthy and not b.draining for b in self.pools[role].backends):
                self.metrics.count(REFUSED, NO_BACKEND)
                down = ", ".join(self.pools[role].down()) or "none"
                raise Refused(
                    503,
                    f"no healthy {role} backend (down: {down})",
                    NO_BACKEND,
                    self.settings.retry_503_s,
                )

    def _place(self, route: Route, tokens: int, pd: bool) -> tuple[Route, Lease] | None:
        """Take room for ``route``: its chosen replica of each role while that is healthy (it
        holds the prompt's cache: the request waits for it), else the pool's own choice among
        the replicas with room; None when a role has none."""
        room = self.room
        decode = self._choose(route.decode, "decode", lambda b: room.decode_fits(b.url, pd))
        if decode is None:
            return None
        prefill = None
        if pd:
            prefill = self._choose(
                route.prefill, "prefill", lambda b: room.prefill_fits(b.url, tokens)
            )
            if prefill is None:
                return None
            p = room.of(prefill.url)
            p.requests += 1
            p.tokens += tokens
        use = room.of(decode.url)
        use.requests += 1
        if pd:
            use.pulls += 1
        placed = route.placed(decode, prefill if pd else route.prefill)
        held = None if prefill is None else prefill.url
        lease = Lease(
            room,
            self.rate,
            clock=self.clock,
            wake=self.wake,
            prefill=held,
            decode=decode.url,
            tokens=tokens,
            pd=pd,
        )
        return placed, lease

    def _choose(
        self, chosen: Backend | None, role: str, fits: Callable[[Backend], bool]
    ) -> Backend | None:
        return scheduler.place(self.pools[role], chosen, fits)

    def _dispatch(self) -> None:
        while True:
            ticket = self.queue.pop(self._fits)
            if ticket is None:
                return
            future = self._waiting.pop(ticket, None)
            if future is None or future.done():
                continue
            route, pd = ticket.need
            placed = self._place(route, ticket.cost, pd)
            assert placed is not None  # _fits said so, and nothing ran in between
            future.set_result(placed)

    def _fits(self, ticket: Ticket) -> bool:
        route, pd = ticket.need
        room = self.room

        def any_fits(chosen: Backend | None, role: str, fits: Callable[[Backend], bool]) -> bool:
            if chosen is not None and scheduler.usable(chosen):
                return fits(chosen)
            return any(fits(b) for b in self._healthy(role))

        if not any_fits(route.decode, "decode", lambda b: room.decode_fits(b.url, pd)):
            return False
        cost = ticket.cost
        return not pd or any_fits(
            route.prefill, "prefill", lambda b: room.prefill_fits(b.url, cost)
        )

    # --- bounds ------------------------------------------------------------------------------

    def _check_bounds(self, flow: Flow, tokens: int) -> None:
        queue, settings = self.queue, self.settings
        depths = queue.depths()
        flows = len(depths) + (flow.name not in depths)
        share = max(1, settings.queue_size // flows)
        own = depths.get(flow.name, 0)
        # The total may pass the bound by one request per flow: a new flow always gets a place.
        if own >= share or len(queue) >= settings.queue_size + flows - 1:
            self.metrics.count(REFUSED, QUEUE_FULL)
            raise Refused(
                429,
                f"the admission queue is full ({len(queue)} waiting, {own} of them yours); "
                "retry later",
                QUEUE_FULL,
                self._predicted(flow, tokens) or settings.queue_timeout,
            )
        wait = self._predicted(flow, tokens)
        if wait is not None and wait > settings.queue_timeout:
            self.metrics.count(REFUSED, QUEUE_WAIT)
            raise Refused(
                429,
                f"the predicted wait ({wait:.0f}s) is past {settings.queue_timeout:g}s "
                "(--queue-timeout); retry later",
                QUEUE_WAIT,
                wait,
            )

    def _predicted(self, flow: Flow, tokens: int) -> float | None:
        """Seconds until a new request of ``flow`` would be admitted, at the measured rate."""
        in_flight = sum(u.tokens for u in self.room.usage.values())
        ahead = self.queue.cost_ahead(flow.name, flow.band, tokens, flow.weight)
        return self.rate.wait(ahead + in_flight // 2)

    # --- bookkeeping ---------------------------------------------------------------------------

    def _leave(self, ticket: Ticket, future: asyncio.Future[tuple[Route, Lease]]) -> None:
        """A waiter that stops waiting: out of the queue, or, if it was just admitted, its room
        goes back."""
        self._waiting.pop(ticket, None)
        if self.queue.remove(ticket):
            return
        if future.done() and not future.cancelled():
            with contextlib.suppress(Exception):
                future.result()[1].release()
        else:
            future.cancel()

    def _observe_wait(self, label: str, ticket: Ticket) -> None:
        self.metrics.waited(label, self.clock() - ticket.arrived)

    def room_rows(self) -> Iterator[tuple[str, str, str, int]]:
        """(role, backend, kind, value) for every replica: the in-flight gauge's samples."""
        for role in ROLES:
            kinds = ("requests", "tokens") if role == "prefill" else ("requests", "pulls")
            for b in self.pools[role].backends:
                use = self.room.of(b.url)
                for kind in kinds:
                    yield role, b.url, kind, getattr(use, kind)
