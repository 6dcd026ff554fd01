"""Helpers the discovery tests share (DNS, endpoints file, Kubernetes API): waiting, fleets of
fake backends on loopback addresses sharing one port, and a completion checked end to end."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp

from pd_proxy.backends.pool import BackendPool
from pd_proxy.testing.fake_vllm import FakeVLLM
from tests.proxy.proxy_harness import Stack, sse_events

HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
WAIT_S = 10.0  # bound of every wait below; the conditions normally hold within a few polls


@asynccontextmanager
async def fleet(role: str, hosts: tuple[str, ...] = HOSTS) -> AsyncIterator[tuple[int, dict]]:
    """One fake per host, all on the same port; stopped on exit whatever happened."""
    fakes: dict[str, FakeVLLM] = {}
    try:
        for _attempt in range(5):  # another process may hold the port on one of the addresses
            port = 0
            try:
                for host in hosts:
                    fake = FakeVLLM(role=role)
                    fakes[host] = fake
                    await fake.start(host, port)
                    port = int(fake.url.rsplit(":", 1)[1])
                break
            except OSError:
                for fake in fakes.values():
                    await fake.stop()
                fakes.clear()
        else:
            raise RuntimeError(f"no port free on all of {hosts}")
        yield port, fakes
    finally:
        for fake in fakes.values():
            await fake.stop()


def url(host: str, port: int) -> str:
    return f"http://{host}:{port}"


def find(pool: BackendPool, target: str):
    """The backend of ``pool`` at ``target``, serving or draining, or None once dropped."""
    for backend in pool.backends + pool.draining:
        if backend.url == target:
            return backend
    return None


async def complete(s: Stack, i: int = 0, stream: bool = False, n: int = 2) -> str | None:
    """One completion through the proxy; None when it came back whole, else what went wrong."""
    body = {"prompt": f"p{i}", "max_tokens": n, "stream": stream}
    try:
        status, _, raw = await s.post("/v1/completions", body)
    except aiohttp.ClientError as exc:
        return f"{i}: {exc!r}"
    if status != 200:
        return f"{i}: {status} {raw[:200]!r}"
    if stream:
        events = sse_events(raw)
        texts = [json.loads(e)["choices"][0]["text"] for e in events[:-1]]
        good = events[-1:] == ["[DONE]"] and texts == [f" t{k}" for k in range(n)]
    else:
        good = json.loads(raw)["choices"][0]["text"] == "".join(f" t{k}" for k in range(n))
    return None if good else f"{i}: bad body {raw[:200]!r}"
