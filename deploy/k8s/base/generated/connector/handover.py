"""Where the P/D handover time goes, per request: events in, phase durations out (no vLLM here).

The connector stamps a request's events where they happen - the scheduler when decode admits it
(waiting for remote KV), sees its transfer finish and runs its first step; the worker when it posts
the KV read and sees it done; prefill's scheduler when the request finished and when its blocks
were freed - and ships them on vLLM's KV-connector stats path. The API server feeds them to a
``HandoverTracker`` per engine, which turns complete sets into phase durations for the
``vllm:nixl_handover_seconds`` histogram. Times are ``time.monotonic()``: Linux's CLOCK_MONOTONIC is
one clock for every process of a host, and an engine's scheduler and workers share a host.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

# Decode side, in order.
ADMITTED = "admitted"  # scheduler: allocated blocks, waiting for remote KV
READ_POSTED = "read_posted"  # worker: NIXL read posted
TRANSFER_DONE = "transfer_done"  # worker: read seen complete
SCHEDULER_SEEN = "scheduler_seen"  # scheduler: finished_recving reached it
FIRST_TOKEN = "first_token"  # scheduler: the request's first step ran
# Prefill side.
PREFILL_DONE = "prefill_done"  # scheduler: request finished, blocks held for decode
BLOCKS_FREED = "blocks_freed"  # scheduler: the canonical finished_sending freed them

# phase label -> (from event, to event); the last event of each side completes a request.
PHASES: dict[str, tuple[str, str]] = {
    "admitted_to_read_posted": (ADMITTED, READ_POSTED),
    "read_posted_to_transfer_done": (READ_POSTED, TRANSFER_DONE),
    "transfer_done_to_scheduler": (TRANSFER_DONE, SCHEDULER_SEEN),
    "scheduler_to_first_token": (SCHEDULER_SEEN, FIRST_TOKEN),
    "admitted_to_first_token": (ADMITTED, FIRST_TOKEN),
    "prefill_kv_hold": (PREFILL_DONE, BLOCKS_FREED),
}
DECODE_PHASES = tuple(p for p in PHASES if p != "prefill_kv_hold")
COMPLETES = {FIRST_TOKEN: DECODE_PHASES, BLOCKS_FREED: ("prefill_kv_hold",)}

Event = tuple[str, str, float]  # (request id, event name, monotonic seconds)


def stamp(request_id: str, event: str, now: float | None = None) -> Event:
    return (request_id, event, time.monotonic() if now is None else now)


@dataclass
class HandoverTracker:
    """Collects one engine's events (they arrive over several steps, from several processes)
    and yields each request's phases once its last event is in. Requests that never complete
    (aborted, failed) are dropped after ``max_age_s`` so the table cannot grow without bound."""

    max_age_s: float = 600.0
    _events: dict[str, dict[str, float]] = field(default_factory=dict)

    def add(self, events: Iterable[Event], now: float | None = None) -> list[tuple[str, float]]:
        done: list[tuple[str, float]] = []
        for request_id, name, when in events:
            seen = self._events.setdefault(request_id, {})
            seen.setdefault(name, when)  # the first stamp of an event counts
            if name in COMPLETES:
                done.extend(self._phases(seen, COMPLETES[name]))
                for phase in COMPLETES[name]:
                    for event in PHASES[phase]:
                        seen.pop(event, None)
                if not seen:
                    del self._events[request_id]
        self._expire(time.monotonic() if now is None else now)
        return done

    @staticmethod
    def _phases(seen: dict[str, float], phases: Iterable[str]) -> list[tuple[str, float]]:
        out = []
        for phase in phases:
            start, end = PHASES[phase]
            if start in seen and end in seen:
                out.append((phase, max(0.0, seen[end] - seen[start])))
        return out

    def _expire(self, now: float) -> None:
        stale = [
            rid
            for rid, seen in self._events.items()
            if seen and now - min(seen.values()) > self.max_age_s
        ]
        for rid in stale:
            del self._events[rid]

    def __len__(self) -> int:
        return len(self._events)
