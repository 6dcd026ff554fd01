"""The canary (``--canary-minutes N``): catches P/D answers that are wrong although nothing failed.

Every N minutes one fixed greedy prompt goes to a prefill backend alone (a vLLM ``kv_producer``
serves a request without ``kv_transfer_params`` in full, as any server would) and then through
the proxy's own P/D legs (``Legs.prefill_leg``, the decode leg through ``Legs.decode_to``:
the same pools, backend key and rewriting as client requests). The two texts must be equal: a
decode that read the wrong KV blocks (an expired lease, blocks freed or reused early, a broken
transfer) answers HTTP 200 with different text, which no error counter shows.

The prompt counts from 1 to 150 (about 450 tokens, so the KV spans several blocks at block size
16 or 128) and asks for 16 more tokens, greedy and with ``ignore_eos``: a continuation whose next
tokens win by a wide margin, so numeric noise between the two paths (batching, PCP vs TP
kernels) does not flip them, while KV from another request does.

Comparison (``compare``, pure): equal texts are a match, byte for byte (the same tokens give the
same text, whitespace included); any difference is a mismatch; a leg that failed (an HTTP error,
a timeout, an answer without text) makes the run an error, never a mismatch. Metrics, on the
proxy's registry: ``pd_proxy_canary_runs_total``, ``pd_proxy_canary_mismatches_total``,
``pd_proxy_canary_errors_total`` and ``pd_proxy_canary_last_run_timestamp_seconds``; the alert
``PdCanaryMismatch`` (compose/prometheus/alerts.yml) reads the mismatches.

The canary runs as one task on the proxy's event loop: its legs are asynchronous like a client's,
a run is bounded by ``--canary-timeout``, and the task stops when the proxy shuts down. With
``--workers N`` only worker 1 runs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from pd_proxy.backends.pool import BackendPool
from pd_proxy.call import backend_fields
from pd_proxy.config.key_files import BackendKey
from pd_proxy.http.exchange import Exchange, read_whole
from pd_proxy.http.upstream import Fields
from pd_proxy.legs import NO_LEASE, Legs
from pd_proxy.protocol.codec import dumps, loads
from pd_proxy.protocol.endpoints import COMPLETIONS
from pd_proxy.protocol.errors import Passthrough, ProxyError
from pd_proxy.protocol.pd_bodies import decode_payload, kv_params_from_prefill, prefill_body
from pd_proxy.tracing import Trace

log = logging.getLogger("pd_proxy.api.canary")

PROMPT = "Count on: " + ", ".join(str(i) for i in range(1, 151)) + ","
MAX_TOKENS = 16
MATCH, MISMATCH, ERROR = "match", "mismatch", "error"
RUNS_TOTAL = "pd_proxy_canary_runs_total"
MISMATCHES_TOTAL = "pd_proxy_canary_mismatches_total"
ERRORS_TOTAL = "pd_proxy_canary_errors_total"
LAST_RUN = "pd_proxy_canary_last_run_timestamp_seconds"
METRIC_NAMES: tuple[str, ...] = (RUNS_TOTAL, MISMATCHES_TOTAL, ERRORS_TOTAL, LAST_RUN)
SNIPPET = 60  # characters of each text quoted around a difference


def canary_request() -> dict[str, Any]:
    """The fixed request: greedy, a fixed length, no model (vLLM serves its base model)."""
    return {
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": False,
    }


@dataclass(frozen=True)
class Leg:
    """One path's answer: its text, or why there is none."""

    text: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class Verdict:
    outcome: str  # MATCH, MISMATCH or ERROR
    detail: str


def leg_from_answer(status: int, data: bytes) -> Leg:
    """A completions answer as a ``Leg``: ``choices[0].text`` of a 200, else an error."""
    if status != 200:
        return Leg(error=f"HTTP {status}: {data[:200].decode('utf-8', 'replace')}")
    try:
        answer = loads(data)
    except (ValueError, UnicodeDecodeError):
        return Leg(error=f"not JSON: {data[:200].decode('utf-8', 'replace')}")
    choices = answer.get("choices") if isinstance(answer, dict) else None
    first = choices[0] if isinstance(choices, list) and choices else None
    text = first.get("text") if isinstance(first, dict) else None
    if not isinstance(text, str):
        return Leg(error="no choices[0].text in the answer")
    return Leg(text=text)


def compare(pd: Leg, alone: Leg) -> Verdict:
    """The run's verdict from the P/D answer and the prefill's own (see the module docstring)."""
    legs = (("P/D", pd), ("prefill alone", alone))
    errors = [f"{name}: {leg.error}" for name, leg in legs if leg.error is not None]
    if errors or pd.text is None or alone.text is None:
        return Verdict(ERROR, "; ".join(errors) or "a leg gave no text")
    if pd.text == alone.text:
        if not pd.text:
            return Verdict(ERROR, "both answers are empty: nothing was compared")
        return Verdict(MATCH, f"{len(pd.text)} characters equal")
    at = next(
        (i for i, (a, b) in enumerate(zip(pd.text, alone.text, strict=False)) if a != b),
        min(len(pd.text), len(alone.text)),
    )
    start = max(0, at - 10)
    return Verdict(
        MISMATCH,
        f"P/D text differs from the prefill's own at character {at}: "
        f"{pd.text[start : at + SNIPPET]!r} vs {alone.text[start : at + SNIPPET]!r}",
    )


class Canary:
    """Runs the comparison every ``interval_s``: the P/D answer through ``legs``, the prefill's
    own through ``exchange`` to the ``prefill`` pool within ``prefill_timeout``, both sent with
    ``backend_key``; metrics on ``registry``."""

    def __init__(
        self,
        legs: Legs,
        exchange: Exchange,
        prefill: BackendPool,
        *,
        backend_key: BackendKey | None,
        prefill_timeout: float,
        registry: CollectorRegistry,
        interval_s: float,
        timeout_s: float,
    ) -> None:
        self.legs = legs
        self.exchange = exchange
        self.prefill_pool = prefill
        self.backend_key = backend_key
        self.prefill_timeout = prefill_timeout
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.runs = Counter(
            "pd_proxy_canary_runs",
            "Canary runs: a fixed greedy prompt through P/D and to a prefill alone.",
            registry=registry,
        )
        self.mismatches = Counter(
            "pd_proxy_canary_mismatches",
            "Canary runs whose P/D text differed from the prefill's own (wrong KV read?).",
            registry=registry,
        )
        self.errors = Counter(
            "pd_proxy_canary_errors",
            "Canary runs that compared nothing: a leg failed, timed out or gave no text.",
            registry=registry,
        )
        self.last_run = Gauge(
            LAST_RUN,
            "Unix time the last canary run ended, whatever its outcome.",
            registry=registry,
            multiprocess_mode="max",
        )
        self.last: Verdict | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Run in the background from now on (first run at once, then every interval)."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="pd-proxy-canary")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _loop(self) -> None:
        while True:
            await self.run_once()
            await asyncio.sleep(self.interval_s)

    async def run_once(self) -> Verdict:
        """One comparison, bounded by ``timeout_s``, counted and logged."""
        try:
            verdict = await asyncio.wait_for(self._compare(), self.timeout_s)
        except asyncio.TimeoutError:
            verdict = Verdict(ERROR, f"no verdict within {self.timeout_s:g}s")
        except Exception as exc:  # a bug must not stop the canary or the proxy
            log.exception("canary run failed")
            verdict = Verdict(ERROR, f"{type(exc).__name__}: {exc}")
        self.runs.inc()
        if verdict.outcome == MISMATCH:
            self.mismatches.inc()
            log.error("canary: MISMATCH: %s", verdict.detail)
        elif verdict.outcome == ERROR:
            self.errors.inc()
            log.warning("canary: error: %s", verdict.detail)
        else:
            log.info("canary: match (%s)", verdict.detail)
        self.last_run.set(time.time())
        self.last = verdict
        return verdict

    async def _compare(self) -> Verdict:
        rid = "canary-" + os.urandom(8).hex()
        alone = await self._prefill_alone(rid + "-alone")
        pd = await self._through_pd(rid)
        return compare(pd, alone)

    def _headers(self, rid: str) -> Fields:
        return backend_fields(rid, self.backend_key)

    async def _prefill_alone(self, rid: str) -> Leg:
        try:
            _, status, data, _ = await self.exchange(
                self.prefill_pool,
                COMPLETIONS,
                dumps(canary_request()),
                self._headers(rid),
                trace=Trace(rid),
                consume=read_whole,
                total=self.prefill_timeout,
            )
        except ProxyError as exc:
            return Leg(error=f"HTTP {exc.status}: {exc.message}")
        return leg_from_answer(status, data)

    async def _through_pd(self, rid: str) -> Leg:
        legs = self.legs
        body = canary_request()
        headers = self._headers(rid)
        trace = Trace(rid)
        try:
            _, prefill = await legs.prefill_leg(
                COMPLETIONS, dumps(prefill_body(body)), headers, trace=trace, lease=NO_LEASE
            )
            try:
                kv = kv_params_from_prefill(prefill)
            except ValueError:
                return Leg(error=f"prefill answered no JSON object: {prefill[:200]!r}")
            _, status, data, _ = await legs.decode_to(
                COMPLETIONS,
                decode_payload(dumps(body), body, kv),
                headers,
                trace=trace,
                consume=read_whole,
            )
        except ProxyError as exc:
            return Leg(error=f"HTTP {exc.status}: {exc.message}")
        except Passthrough as exc:
            return Leg(error=f"HTTP {exc.status}: {exc.body[:200].decode('utf-8', 'replace')}")
        return leg_from_answer(status, data)
