"""`bench scale`'s I/O on one event loop: timed requests, streams' inter-token gaps, /metrics
samples while events pour in, and the fake fleet's control calls (pd_proxy.testing.fake_fleet)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from pcp_pd_kit.bench import scale_report as report

DONE = b"data: [DONE]\n\n"
SCRAPE_EVERY_S = 0.25
WARM_S = 0.5  # lag samples from this far into a step on: every publisher has sent by then


def auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def control(session: aiohttp.ClientSession, fleet: str, name: str, **body: Any) -> Any:
    """One fleet control call (``POST /fleet/<name>``, or ``GET /fleet/stats``)."""
    if name == "stats":
        async with session.get(f"{fleet}/fleet/stats") as resp:
            return await resp.json()
    async with session.post(f"{fleet}/fleet/{name}", json=body) as resp:
        answer = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"fleet {name}: {answer}")
        return answer


async def sent(session: aiohttp.ClientSession, fleet: str, publishers: Sequence[int]) -> int:
    """Events the chosen publishers sent since the fleet's last restart."""
    events = (await control(session, fleet, "stats"))["events"]
    return sum(events[i] for i in publishers)


async def page(session: aiohttp.ClientSession, url: str, key: str | None = None) -> str:
    async with session.get(f"{url}/metrics", headers=auth(key)) as resp:
        return await resp.text()


Session = aiohttp.ClientSession


async def timed(session: Session, url: str, bodies: Sequence[bytes], concurrency: int = 1,
                keys: Sequence[str] = ()) -> tuple[list[float], int]:  # fmt: skip
    """Each body streamed through ``url`` once (request i with key i mod len(keys)): the seconds
    of those that ended in [DONE], and how many did not."""
    latencies: list[float] = []
    errors = 0
    todo = iter(range(len(bodies)))
    base = {"Content-Type": "application/json"}

    async def worker() -> None:
        nonlocal errors
        for i in todo:
            headers = {**base, **auth(keys[i % len(keys)] if keys else None)}
            start = time.perf_counter()
            try:
                async with session.post(f"{url}/v1/completions", data=bodies[i],
                                        headers=headers) as resp:  # fmt: skip
                    ok = resp.status == 200 and (await resp.read()).endswith(DONE)
            except (aiohttp.ClientError, asyncio.TimeoutError):
                ok = False
            if ok:
                latencies.append(time.perf_counter() - start)
            else:
                errors += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, errors


async def stream_gaps(session: aiohttp.ClientSession, url: str, body: bytes, concurrency: int,
                      seconds: float) -> tuple[list[float], int]:  # fmt: skip
    """Streams one after another on ``concurrency`` connections for ``seconds``: the gaps between
    a stream's successive events (its first token excluded), and streams that broke."""
    gaps: list[float] = []
    errors = 0
    deadline = time.monotonic() + seconds
    headers = {"Content-Type": "application/json"}

    async def worker() -> None:
        nonlocal errors
        while time.monotonic() < deadline:
            last, tail = None, b""
            try:
                async with session.post(f"{url}/v1/completions", data=body,
                                        headers=headers) as resp:  # fmt: skip
                    async for line in resp.content:
                        if line.startswith(b"data: "):
                            now = time.perf_counter()
                            if last is not None:
                                gaps.append(now - last)
                            last, tail = now, line
            except (aiohttp.ClientError, asyncio.TimeoutError):
                tail = b""
            if not tail.startswith(b"data: [DONE]"):
                errors += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return gaps, errors


async def lags(session: aiohttp.ClientSession, url: str, seconds: float) -> list[float]:
    """The proxy's lag gauge of every replica, sampled four times a second from ``WARM_S`` on."""
    out: list[float] = []
    start = time.monotonic()
    while (now := time.monotonic()) < start + seconds:
        if now >= start + WARM_S:
            out += [v for _, v in report.samples(await page(session, url), report.LAG)]
        await asyncio.sleep(SCRAPE_EVERY_S)
    return out


async def until(session: aiohttp.ClientSession, url: str, reached: Any, timeout_s: float,
                key: str | None = None) -> bool:  # fmt: skip
    """Poll the proxy's /metrics until ``reached(text)``; False when it never did."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if reached(await page(session, url, key)):
            return True
        await asyncio.sleep(0.1)
    return False
