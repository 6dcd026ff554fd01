"""In-process P/D stacks for the proxy tests: fake prefill/decode backends plus a real proxy."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from pd_proxy.api.app import PROXY_KEY, RUNNING_KEY, build_app, build_metrics_app, make_runner
from pd_proxy.config import ProxyConfig
from pd_proxy.testing.fake_model import DECODE, PREFILL
from pd_proxy.testing.fake_vllm import FakeVLLM
from tests.support.net import closed_port_url

# The prefill leg's kv_transfer_params as the protocol spells it, written out independently of
# pd_proxy.protocol.pd_bodies so the tests check the implementation against the spec.
EXPECTED_PREFILL_KV = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass
class Stack:
    url: str
    prefills: list[FakeVLLM]
    decodes: list[FakeVLLM]
    app: web.Application
    session: aiohttp.ClientSession
    dead: list[str] = field(default_factory=list)
    metrics_url: str | None = None  # the --metrics-port listener, when the config has one

    @property
    def prefill(self) -> FakeVLLM:
        return self.prefills[0]

    @property
    def decode(self) -> FakeVLLM:
        return self.decodes[0]

    def revive_dead(self) -> None:
        """Pretend the dead backends passed their last check (they died since)."""
        for pool in (self.proxy.prefill_pool, self.proxy.decode_pool):
            for backend in pool.backends:
                if backend.url in self.dead:
                    backend.healthy = True

    @property
    def proxy(self):
        return self.app[PROXY_KEY]

    @property
    def running(self):
        """The parts built when the proxy started (pd_proxy.api.app.Running)."""
        return self.app[RUNNING_KEY]

    @property
    def metrics(self):
        return self.app[PROXY_KEY].metrics

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        return self.metrics.registry.get_sample_value(name, labels or {})

    async def post(self, path: str, body, headers=None) -> tuple[int, CIMultiDict, bytes]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self.session.post(self.url + path, data=data, headers=headers) as r:
            return r.status, r.headers.copy(), await r.read()

    async def get(self, path: str, headers=None, base: str | None = None) -> tuple[int, bytes]:
        async with self.session.get((base or self.url) + path, headers=headers) as r:
            return r.status, await r.read()


@asynccontextmanager
async def pd_stack(
    prefills: int = 1,
    decodes: int = 1,
    dead_prefills: int = 0,
    dead_decodes: int = 0,
    backend_key: str | None = None,
    **options,
) -> AsyncIterator[Stack]:
    """Start fakes and a proxy on ephemeral loopback ports; everything stops on exit.

    ``backend_key`` makes every fake require it, as ``vllm serve --api-key`` does. With a
    ``metrics_port`` option the metrics listener also runs, on an ephemeral port.
    """
    fakes_p = [FakeVLLM(role=PREFILL, api_key=backend_key) for _ in range(prefills)]
    fakes_d = [FakeVLLM(role=DECODE, api_key=backend_key) for _ in range(decodes)]
    started: list[FakeVLLM] = []
    runner = None
    metrics_runner = None
    session = None
    try:
        for fake in fakes_p + fakes_d:
            await fake.start()
            started.append(fake)
        dead_p = [closed_port_url() for _ in range(dead_prefills)]
        dead_d = [closed_port_url() for _ in range(dead_decodes)]
        options.setdefault("health_interval", 30.0)
        config = ProxyConfig(
            prefill=tuple([f.url for f in fakes_p] + dead_p),
            decode=tuple([f.url for f in fakes_d] + dead_d),
            host="127.0.0.1",
            port=0,
            **options,
        )
        app = build_app(config)
        runner = make_runner(app, config)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        metrics_url = None
        metrics_app = build_metrics_app(app)
        if metrics_app is not None:
            metrics_runner = web.AppRunner(metrics_app)
            await metrics_runner.setup()
            await web.TCPSite(metrics_runner, "127.0.0.1", 0).start()
            m_host, m_port = metrics_runner.addresses[0][:2]
            metrics_url = f"http://{m_host}:{m_port}"
        # Start from a settled state: the first health round has run.
        await app[RUNNING_KEY].checker.first_round.wait()
        session = aiohttp.ClientSession()
        yield Stack(
            f"http://{host}:{port}", fakes_p, fakes_d, app, session, dead_p + dead_d, metrics_url
        )
    finally:
        if session is not None:
            await session.close()
        if metrics_runner is not None:
            await metrics_runner.cleanup()
        if runner is not None:
            await runner.cleanup()
        for fake in started:
            await fake.stop()


def sse_events(raw: bytes) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order."""
    events = []
    for block in raw.decode().split("\n\n"):
        block = block.strip()
        if block.startswith("data: "):
            events.append(block[len("data: ") :])
    return events
