"""The rate at which admitted work finishes, in prompt tokens per second, over the last few
completions: what turns the tokens queued ahead of a request into its predicted wait. Pure."""

from __future__ import annotations

from collections import deque

WINDOW = 32  # completions remembered
MIN_SAMPLES = 4  # fewer: no prediction (the queue's length bound still holds)


class Rate:
    def __init__(self, window: int = WINDOW) -> None:
        self._done: deque[tuple[float, int]] = deque(maxlen=window)

    def done(self, now: float, tokens: int) -> None:
        self._done.append((now, max(1, tokens)))

    def per_second(self) -> float | None:
        if len(self._done) < MIN_SAMPLES:
            return None
        first, last = self._done[0][0], self._done[-1][0]
        if last <= first:
            return None
        # The first completion opens the window: only what finished after it counts.
        return sum(t for _, t in list(self._done)[1:]) / (last - first)

    def wait(self, tokens: int) -> float | None:
        """Seconds to serve ``tokens`` at the measured rate; None before there is one."""
        rate = self.per_second()
        return None if rate is None else tokens / rate
