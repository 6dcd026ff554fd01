"""Waiting in async tests on a condition, never on a fixed sleep: a loaded host (CI builds the
images while the unit tests run) may stall the event loop past any short sleep."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(predicate: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    """Poll ``predicate`` until it holds; fail the test naming ``what`` after ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for: {what}")
        await asyncio.sleep(0.01)
