"""The test OTLP/HTTP receiver (otlp_receiver.py) on a thread with its own event loop, for spans
exported by other processes (the vLLM servers, pd-proxy) for as long as they run, read from
synchronous tests."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager

from tests.support.otlp_receiver import Received, Receiver, otlp_receiver


@contextmanager
def receiver_thread(host: str = "127.0.0.1") -> Iterator[Receiver]:
    """A running receiver (``.url`` its /v1/traces URL); stopped, its thread joined, on exit."""
    loop = asyncio.new_event_loop()
    started: Future[Receiver] = Future()
    stop = asyncio.Event()

    async def serve() -> None:
        try:
            async with otlp_receiver(host) as receiver:
                started.set_result(receiver)
                await stop.wait()
        except BaseException as exc:
            if not started.done():
                started.set_exception(exc)
            raise

    thread = threading.Thread(
        target=loop.run_until_complete, args=(serve(),), name="otlp-receiver", daemon=True
    )
    thread.start()
    try:
        yield started.result(timeout=30)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=30)
        if not thread.is_alive():
            loop.close()


def wait_for_spans(
    receiver: Receiver, done: Callable[[list[Received]], bool], timeout_s: float
) -> list[Received]:
    """The receiver's spans once ``done(spans)`` holds; AssertionError with what did arrive
    after ``timeout_s`` (exporters batch: vLLM's and pd-proxy's send every ~5 s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = list(receiver.spans)  # a copy: the receiver's thread appends
        if done(spans):
            return spans
        if time.monotonic() > deadline:
            got = sorted({(s.service, s.name) for s in spans})
            raise AssertionError(f"spans never arrived within {timeout_s:g}s; got {got}")
        time.sleep(0.1)
