"""The rate at which admitted work finishes while there is work, in prompt tokens per second over
the last few completions: what turns the tokens queued ahead of a request into its predicted wait.

Only busy time counts. A light client's request every few seconds must not read as a slow server:
the time between two completions counts only while some rate-counted work was in flight, so an idle
gap adds nothing (counting it once predicted waits ten times the real ones). Pure.
"""

from __future__ import annotations

from collections import deque

WINDOW = 32  # completions remembered
MIN_SAMPLES = 4  # fewer: no prediction (the queue's length bound still holds)


class Rate:
    def __init__(self, window: int = WINDOW) -> None:
        self._done: deque[tuple[int, float]] = deque(maxlen=window)  # (tokens, busy seconds)
        self._open = 0  # work begun and not yet ended
        self._since = 0.0  # where the next completion's busy interval starts

    def begin(self, now: float) -> None:
        """Work started; when nothing was in flight, the busy clock starts now."""
        if self._open == 0:
            self._since = now
        self._open += 1

    def end(self, now: float, tokens: int | None) -> None:
        """Work ended: served ``tokens``, or None when it was abandoned (its time still counts
        toward the next completion: the server spent it)."""
        self._open = max(0, self._open - 1)
        if tokens is None:
            return
        self._done.append((max(1, tokens), max(0.0, now - self._since)))
        self._since = now

    def per_second(self) -> float | None:
        if len(self._done) < MIN_SAMPLES:
            return None
        seconds = sum(s for _, s in self._done)
        if seconds <= 0:
            return None
        return sum(t for t, _ in self._done) / seconds

    def wait(self, tokens: int) -> float | None:
        """Seconds to serve ``tokens`` at the measured rate; None before there is one."""
        rate = self.per_second()
        return None if rate is None else tokens / rate
