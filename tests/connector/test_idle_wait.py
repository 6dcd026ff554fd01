"""Workers sleep between looks for the next step instead of spinning: vLLM's real shared-memory
ring, one writer and one reader, the reader's CPU time while it waits half a second for a step,
then a burst of steps back to back (a lost wake-up would show as a step that takes seconds)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from pcp_nixl_connector.cpu_compat import idle_wait, upstream_gate

pytestmark = pytest.mark.vllm

WAIT_S = 0.5
BURST = 200


@pytest.fixture
def spin_cls(monkeypatch: pytest.MonkeyPatch) -> type:
    """vLLM's SpinCondition with its own ``wait``, restored after the test."""
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    stock = SpinCondition.wait
    monkeypatch.setattr(SpinCondition, "wait", getattr(stock, "__wrapped__", stock))
    return SpinCondition


def reader_waits() -> dict[str, Any]:
    """A step, the next one ``WAIT_S`` later, then ``BURST`` steps each sent once the reader took
    the one before: what the reader got, its CPU seconds during the wait, the burst's wall time."""
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    writer = MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=4)
    handle = writer.export_handle()
    seen: dict[str, Any] = {"got": []}
    taken = threading.Semaphore(0)

    def read() -> None:
        reader = MessageQueue.create_from_handle(handle, 0)
        reader.wait_until_ready()
        seen["got"].append(reader.dequeue(timeout=30))
        started = time.thread_time()
        seen["got"].append(reader.dequeue(timeout=30))
        seen["cpu_s"] = time.thread_time() - started
        for _ in range(BURST):
            seen["got"].append(reader.dequeue(timeout=30))
            taken.release()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    writer.wait_until_ready()
    writer.enqueue(0)
    time.sleep(WAIT_S)
    writer.enqueue(1)
    started = time.monotonic()
    for step in range(2, BURST + 2):
        writer.enqueue(step)
        assert taken.acquire(timeout=30), f"the reader never took step {step}"
    seen["burst_s"] = time.monotonic() - started
    thread.join(30)
    assert not thread.is_alive()
    return seen


def test_stock_readers_spin_while_they_wait(spin_cls: type) -> None:
    """The upstream behaviour the fix exists for (fails once vLLM stops spinning by default)."""
    seen = reader_waits()
    assert seen["got"] == list(range(BURST + 2))
    assert seen["cpu_s"] > WAIT_S / 5, seen


def test_with_the_fix_a_waiting_reader_sleeps_and_still_gets_every_step_at_once(
    spin_cls: type,
) -> None:
    assert idle_wait.install(spin_cls, vllm_version="0.32.0") is True
    assert idle_wait.install(spin_cls, vllm_version="0.32.0") is False
    seen = reader_waits()
    assert seen["got"] == list(range(BURST + 2))
    assert seen["cpu_s"] < WAIT_S / 10, seen
    # Steps sent back to back are picked up within the shortest sleeps, not a millisecond each.
    assert seen["burst_s"] < BURST * idle_wait.MAX_SLEEP_S / 2, seen


def test_the_sleep_is_a_tenth_of_the_wait_within_bounds() -> None:
    assert idle_wait.sleep_s(0.0) == idle_wait.MIN_SLEEP_S
    assert idle_wait.sleep_s(0.002) == pytest.approx(0.0002)
    assert idle_wait.sleep_s(5.0) == idle_wait.MAX_SLEEP_S


def test_an_unchecked_vllm_is_refused(spin_cls: type) -> None:
    with pytest.raises(upstream_gate.UpstreamGateError, match="sched_yield spin"):
        idle_wait.install(spin_cls, vllm_version="0.34.0")
    assert not idle_wait.installed(spin_cls)
