"""One exchange with a backend of a pool: a leg's whole life, for the legs (pd_proxy.legs) and the
side calls that go to a backend the same way (the planner's ``/tokenize``, the canary).

pd_proxy.http.upstream does the HTTP; this module decides what a failure means. A refused
connection marks the backend down and goes to another once; the prefill leg also moves once when
its backend goes down while it waits (a hung replica, pd_proxy.backends.breaker) or its connection
breaks before an answer, and goes once more when a reused connection closed before any answer;
every other upstream failure becomes a ``ProxyError`` (502, or 504 for a time limit).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import NamedTuple, TypeVar

from pd_proxy import scheduler
from pd_proxy.backends.breaker import Breaker
from pd_proxy.backends.pool import Backend, BackendPool
from pd_proxy.http.connection import (
    ConnectFailed,
    Reply,
    StaleConnection,
    UpstreamBroken,
    UpstreamTimeout,
)
from pd_proxy.http.upstream import Fields, Upstream
from pd_proxy.metrics import ProxyMetrics
from pd_proxy.protocol.endpoints import JSON_TYPE
from pd_proxy.protocol.errors import ProxyError
from pd_proxy.tracing import Trace, end_leg, traceparent

log = logging.getLogger("pd_proxy.request")

T = TypeVar("T")


class Move(NamedTuple):
    """Why a leg's attempt ended, and where it goes again (None: nowhere healthy)."""

    why: str
    to: Backend | None
    reason: str  # pd_proxy_retries_total's label


async def read_whole(backend: Backend, resp: Reply) -> tuple[Backend, int, bytes, str]:
    """Prefill answers are small JSON: read them whole while the backend still counts them."""
    data = await resp.read()
    return backend, resp.status, data, resp.headers.get("content-type", JSON_TYPE)


def pick(pool: BackendPool, exclude: Backend | None = None) -> Backend:
    """The backend for a request to ``pool``; a 503 naming the down ones when none is healthy."""
    backend = scheduler.pick(pool, exclude=exclude)
    if backend is None:
        raise ProxyError(
            503, f"no healthy {pool.role} backend (down: {', '.join(pool.down()) or 'none'})"
        )
    return backend


def mark_down(metrics: ProxyMetrics, backend: Backend, stage: str) -> None:
    """Passive health: a refused connection takes the backend out until a check passes (its
    waiting prefill legs move to another)."""
    backend.went_down()
    metrics.set_health(backend.role, backend.url, False)
    metrics.backend_error(stage, backend.url)


class Exchange:
    """Exchanges with the backends through one app's ``upstream`` client."""

    def __init__(self, metrics: ProxyMetrics, upstream: Upstream) -> None:
        self.metrics = metrics
        self.upstream = upstream

    async def __call__(
        self,
        pool: BackendPool,
        path: str,
        payload: bytes,
        headers: Fields,
        *,
        trace: Trace,
        consume: Callable[[Backend, Reply], Awaitable[T]],
        total: float | None = None,
        silence: float | None = None,
        movable: bool = False,
        want: Backend | None = None,
        tokens: int = 0,
    ) -> T:
        """POST to a backend of ``pool`` (``pick``) and hand its answer to ``consume``.

        One attempt's whole life (connect, headers, body) sits inside one ``outstanding``
        increment, so a cancelled client cannot leak it. A leg goes at most twice:

        - a refused connection (the request never left) marks the backend down and goes to
          another, for every leg;
        - a ``movable`` leg (the prefill's: it has no answer to lose) also goes again when its
          backend goes down while it waits (pd_proxy.backends.pool ``Backend.went_down``: a hung
          replica), or the connection broke before an answer (to another backend), or a reused
          connection closed before any answer (the same backend, on a new connection). What the
          first attempt may hold on its backend is freed there: the closed connection aborts
          the request, and KV already handed out expires with its lease.

        ``want`` is the backend the route chose ahead; it takes the leg while it is healthy and
        not draining, else the pool picks. ``tokens`` (the route's uncached prompt tokens this
        leg computes) count in the backend's ``tokens_in_flight`` while the leg runs there: the
        work the cache scorer sees queued on it. Each retry is counted in
        ``pd_proxy_retries_total``. Other upstream errors become a ``ProxyError`` (502, or 504
        for a time limit). ``total`` bounds each attempt (connect included), ``silence`` each
        wait for the backend.
        """
        upstream = self.upstream
        stage = pool.role
        backend = want if want is not None and scheduler.usable(want) else pick(pool)
        task = asyncio.current_task() if movable else None
        moved = resent = False  # at most one move to another backend, one resend on a new conn
        otel = trace.otel
        while True:
            backend.outstanding += 1
            backend.tokens_in_flight += tokens
            if task is not None:
                backend.waiters[task] = False
            answered = False
            sent = headers
            span = None
            if otel is not None:
                span = otel.leg(stage, path, backend.url)
                sent = Fields(headers + traceparent(span))
            try:
                deadline = None if total is None else upstream.loop.time() + total
                resp = await upstream.post(
                    backend, path, sent, payload, deadline=deadline, silence=silence
                )
                answered = True
                backend.progress += 1
                try:
                    result = await consume(backend, resp)
                finally:
                    status = resp.status  # release() resets it when the connection is reused
                    resp.release()  # closes the connection if the body was not read to the end
                    if span is not None:
                        end_leg(span, status)
                        span = None
                if backend.probing:
                    Breaker.proved(backend)
                return result
            except asyncio.CancelledError:
                # Told to move (its backend went down), not the client leaving: go elsewhere.
                if task is None or not backend.waiters.get(task) or task.uncancel() > 0:
                    raise
                move = Move(
                    "went down before answering", scheduler.pick(pool, exclude=backend), "unhealthy"
                )
            except StaleConnection as exc:
                if not movable:
                    self.metrics.backend_error(stage, backend.url)
                    raise ProxyError(502, f"{stage} backend {backend.url} failed: {exc}") from None
                move = Move(str(exc), backend, "stale_connection")
            except ConnectFailed as exc:
                if task is not None:
                    backend.waiters.pop(task, None)  # the move below is this leg's own
                mark_down(self.metrics, backend, stage)
                move = Move(
                    f"unreachable: {exc}", scheduler.pick(pool, exclude=backend), "unreachable"
                )
            except UpstreamTimeout:
                self.metrics.backend_error(stage, backend.url)
                limit = f"timed out after {total:g}s" if total else f"sent nothing for {silence:g}s"
                raise ProxyError(504, f"{stage} backend {backend.url} {limit}") from None
            except UpstreamBroken as exc:
                self.metrics.backend_error(stage, backend.url)
                if not movable or answered:
                    raise ProxyError(502, f"{stage} backend {backend.url} failed: {exc}") from None
                move = Move(f"failed: {exc}", scheduler.pick(pool, exclude=backend), "broken")
            finally:
                backend.outstanding -= 1
                backend.tokens_in_flight -= tokens
                if task is not None:
                    backend.waiters.pop(task, None)
                if span is not None:  # the attempt ended before an answer
                    end_leg(span, None, "no answer")
            again = resent if move.to is backend else moved
            if again or move.to is None:
                raise ProxyError(502, f"{stage} backend {backend.url} {move.why}")
            log.log(
                logging.INFO if move.to is backend else logging.WARNING,  # an idle close: routine
                "rid=%s %s %s %s, sending again to %s",
                trace.rid,
                stage,
                backend.url,
                move.why,
                move.to.url,
            )
            self.metrics.retry(stage, move.reason)
            if move.to is backend:
                resent = True
            else:
                moved = True
            backend = move.to
