"""A stop asked for while the entrypoint waits (for a slot, for GPU memory), before vLLM runs."""

from __future__ import annotations

import signal
import time


class StopFlag:
    """SIGTERM/SIGINT while the entrypoint waits (for a slot, for GPU memory): a clean exit."""

    def __init__(self) -> None:
        self.asked = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._set)

    def _set(self, _signum: int, _frame: object) -> None:
        self.asked = True

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True as soon as a stop was asked."""
        deadline = time.monotonic() + seconds
        while not self.asked and time.monotonic() < deadline:
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        return self.asked
