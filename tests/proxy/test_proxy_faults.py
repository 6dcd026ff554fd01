"""A sick prefill replica costs no client its answer: the held-out check of the proxy's failure
paths, with real processes so the faults are real.

Two fake prefills run as their own processes; one is frozen (SIGSTOP: the kernel still accepts
its connections, nothing answers), resumed (SIGCONT), then killed (SIGKILL), under steady
traffic. Every request must be answered 200, none may wait for the prefill timeout, and the
frozen replica must be reported down within seconds and healthy again once it resumes.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
from aiohttp import web

from pd_proxy.api.app import PROXY_KEY, build_app, make_runner
from pd_proxy.config import ProxyConfig
from pd_proxy.testing.fake_model import DECODE, PREFILL
from pd_proxy.testing.fake_vllm import FakeVLLM

PREFILL_TIMEOUT_S = 20.0  # a request that waited for it would stand out
CONCURRENCY = 6
SLOW_S = 3.0


@asynccontextmanager
async def fake_process(role: str) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    """``python -m pd_proxy.testing.fake_vllm`` in its own process; its URL from its first line."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "pd_proxy.testing.fake_vllm",
        "--role",
        role,
        "--port",
        "0",
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        assert line.startswith("listening on "), line
        yield proc, line.split()[-1]
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        await proc.wait()


async def prefill_state(session: aiohttp.ClientSession, proxy: str, url: str) -> bool:
    async with session.get(f"{proxy}/health") as r:
        return json.loads(await r.read())["prefill"][url]


async def wait_for_state(
    session: aiohttp.ClientSession, proxy: str, url: str, healthy: bool, limit: float
) -> float:
    """Seconds until ``/health`` reports ``url`` as ``healthy``; fails after ``limit``."""
    start = time.perf_counter()
    while await prefill_state(session, proxy, url) != healthy:
        assert time.perf_counter() - start < limit, f"{url} not healthy={healthy} in {limit}s"
        await asyncio.sleep(0.05)
    return time.perf_counter() - start


async def test_a_frozen_then_resumed_then_killed_prefill_costs_no_request():
    async with fake_process(PREFILL) as (sick, sick_url), fake_process(PREFILL) as (_, well_url):
        decode = FakeVLLM(role=DECODE, record=False)
        await decode.start()
        config = ProxyConfig(
            prefill=(sick_url, well_url),
            decode=(decode.url,),
            host="127.0.0.1",
            port=0,
            health_interval=0.25,
            health_timeout=0.5,
            connect_timeout=1.0,
            prefill_timeout=PREFILL_TIMEOUT_S,
        )
        app = build_app(config)
        runner = make_runner(app, config)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        proxy = f"http://{host}:{port}"
        results: list[tuple[int, float]] = []
        stop = asyncio.Event()

        async def client(session: aiohttp.ClientSession, k: int) -> None:
            i = 0
            while not stop.is_set():
                body = {"prompt": f"c{k} r{i}", "max_tokens": 2, "stream": i % 2 == 0}
                start = time.perf_counter()
                async with session.post(f"{proxy}/v1/completions", json=body) as r:
                    await r.read()
                    results.append((r.status, time.perf_counter() - start))
                i += 1

        try:
            async with aiohttp.ClientSession() as session:
                clients = [asyncio.create_task(client(session, k)) for k in range(CONCURRENCY)]
                await asyncio.sleep(0.5)
                sick.send_signal(signal.SIGSTOP)
                down_s = await wait_for_state(session, proxy, sick_url, False, 5.0)
                # Frozen long enough that a request left on it would be one of the slow ones.
                await asyncio.sleep(SLOW_S)
                sick.send_signal(signal.SIGCONT)
                up_s = await wait_for_state(session, proxy, sick_url, True, 5.0)
                await asyncio.sleep(0.5)
                sick.kill()
                await sick.wait()
                await asyncio.sleep(1.0)
                stop.set()
                await asyncio.gather(*clients)
            metrics = app[PROXY_KEY].metrics
            moved = metrics.registry.get_sample_value(
                "pd_proxy_retries_total", {"stage": "prefill", "reason": "unhealthy"}
            )
        finally:
            await runner.cleanup()
            await decode.stop()
    statuses = [status for status, _ in results]
    slow = [round(t, 2) for _, t in results if t > SLOW_S]
    print(f"{len(results)} requests, down in {down_s:.2f}s, up in {up_s:.2f}s, slow: {slow}")
    assert len(results) > 50
    assert statuses == [200] * len(results), sorted(set(statuses))
    assert len(slow) <= 3 and max(t for _, t in results) < PREFILL_TIMEOUT_S / 2, slow
    assert moved is not None and moved >= 1  # legs stuck on the frozen replica went elsewhere
