"""Admission through the real proxy and fake vLLM backends: a flood from one key beside a light
client, the bounds answered at once, and a client that leaves while queued."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path

from pd_proxy.protocol.endpoints import COMPLETIONS
from tests.proxy.proxy_harness import Stack, pd_stack

FLOOD, LIGHT = "sk-flood", "sk-light"
LIMITS = {
    "prefill_max_inflight": 2,
    "queue_size": 8,
    "queue_timeout": 20.0,
}


def keys(tmp_path: Path) -> str:
    path = tmp_path / "keys"
    path.write_text(f"{FLOOD} flow=flood\n{LIGHT} flow=light\n")
    return str(path)


async def timed(stack: Stack, key: str, rid: str) -> tuple[int, float, dict[str, str], bytes]:
    start = time.perf_counter()
    status, headers, raw = await stack.post(
        COMPLETIONS,
        {"prompt": "a b c d", "max_tokens": 2},
        {"Authorization": f"Bearer {key}", "X-Request-Id": rid},
    )
    return status, time.perf_counter() - start, dict(headers), raw


async def test_a_flood_is_bounded_and_the_light_client_keeps_its_pace(tmp_path: Path) -> None:
    async with pd_stack(api_key_file=keys(tmp_path), **LIMITS) as s:
        s.prefill.knobs.delay = 0.15  # the scarce role: two prefill legs at a time
        alone = [(await timed(s, LIGHT, f"alone-{i}"))[1] for i in range(3)]
        flood = [asyncio.create_task(timed(s, FLOOD, f"flood-{i}")) for i in range(60)]
        await asyncio.sleep(0.05)  # the flood has arrived: two in flight, its share queued
        light = [await timed(s, LIGHT, f"light-{i}") for i in range(5)]
        results = await asyncio.gather(*flood)

    served = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] != 200]
    assert served and refused, [r[0] for r in results]
    for status, elapsed, headers, raw in refused:
        assert status == 429 and int(headers["Retry-After"]) >= 1, raw
        assert elapsed < 2.0  # refused at once, never after a wait
        error = json.loads(raw)["error"]
        assert error["type"] == "rate_limit_exceeded" and error["code"] == "queue_full"
    assert all(status == 200 for status, *_ in light)  # the light client is never refused
    ratio = statistics.median(r[1] for r in light) / statistics.median(alone)
    # Its requests wait for about one flood prefill, not behind the flood's queue.
    assert ratio < 5, (ratio, [round(r[1], 3) for r in light], alone)
    # No backend heard of a refused request.
    seen = {x.headers["X-Request-Id"] for x in s.prefill.seen}
    assert not seen & {f"flood-{i}" for i, r in enumerate(results) if r[0] != 200}


async def test_a_client_that_leaves_while_queued_never_reaches_a_backend(tmp_path: Path) -> None:
    async with pd_stack(api_key_file=keys(tmp_path), **LIMITS) as s:
        s.prefill.knobs.delay = 1.0
        busy = [asyncio.create_task(timed(s, FLOOD, f"busy-{i}")) for i in range(2)]
        await s.prefill.wait_for(lambda: len(s.prefill.seen) == 2)
        leaving = asyncio.create_task(timed(s, LIGHT, "leaves"))
        gate = s.running.pipeline.gate
        assert gate is not None
        deadline = time.monotonic() + 5
        while not len(gate.queue) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert len(gate.queue) == 1
        leaving.cancel()  # the client hangs up while it waits
        deadline = time.monotonic() + 5
        while len(gate.queue) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert len(gate.queue) == 0
        await asyncio.gather(*busy)
        await asyncio.sleep(0.2)
        rids = [x.headers["X-Request-Id"] for x in s.prefill.seen + s.decode.seen]
        assert "leaves" not in rids
        sample = s.sample("pd_proxy_admission_total", {"outcome": "left", "reason": "client_gone"})
        assert sample == 1
