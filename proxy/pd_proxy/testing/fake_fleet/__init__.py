"""A fleet of fake vLLM replicas in one process, for measuring pd-proxy at a cluster's scale
(``pcp-pd-kit bench scale``): R prefills and R decodes (pd_proxy.testing.fake_vllm) that answer
the P/D legs at once, each with a KV-event publisher as vLLM's (pd_proxy.testing.kv_publisher)
that its ``GET /kv_event_sources`` names; and a control API on its own port.

Control (JSON bodies; ``replicas``: the first N of each role, prefills then decodes):

- ``GET /fleet``: the replicas' URLs; ``GET /fleet/stats``: events published per publisher;
- ``POST /fleet/store {"tokens", "replicas"}``: every chosen replica stores the prompt's blocks;
- ``POST /fleet/fill {"blocks", "replicas"}``: each stores that many new blocks, 64 per event;
- ``POST /fleet/pump {"rate", "seconds", "replicas"}``: the churn (store, evict), one block per
  event, at ``rate`` events a second over the chosen publishers, one batch each per 20 ms tick;
- ``POST /fleet/heartbeat {"interval"}``: an empty batch from a publisher idle that long (0: off);
- ``POST /fleet/restart``: every publisher as a restarted engine (empty, sequence from 0);
- ``POST /fleet/knobs {...}``: set ``fake_vllm.Knobs`` fields on every replica.

Replays are answered every tick. Run it with ``python -m pd_proxy.testing.fake_fleet``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

import zmq
from aiohttp import web

from pd_proxy.testing.fake_fleet import workload
from pd_proxy.testing.fake_model import DECODE, PREFILL
from pd_proxy.testing.fake_vllm import FakeVLLM, Knobs
from pd_proxy.testing.kv_publisher import Publisher, prompt_events

TICK_S = 0.02  # one engine step: each publisher sends at most one batch per tick


@dataclass
class EventfulFake(FakeVLLM):
    """A fake vLLM that names its KV-event publisher at ``GET /kv_event_sources``, as vLLM 0.32's
    API server does: ``{"<dp rank>": KVEventsConfig}``."""

    sources: dict[str, Any] = field(default_factory=dict)

    def build_app(self) -> web.Application:
        app = super().build_app()
        app.router.add_get("/kv_event_sources", self._sources)
        return app

    async def _sources(self, request: web.Request) -> web.Response:
        return web.json_response(self.sources)


@dataclass
class Pump:
    """The churn in progress: its rate, end, publishers and where each is in its ring."""

    rate: float = 0.0
    until: float = 0.0
    targets: list[int] = field(default_factory=list)
    last: float = 0.0
    carry: float = 0.0
    turn: int = 0  # which publisher gets the remainder first this tick


class Fleet:
    def __init__(self, replicas: int, block_size: int, host: str = "127.0.0.1") -> None:
        self.block_size = block_size
        self.host = host
        self.ctx = zmq.Context()
        self.fakes = [EventfulFake(role=role, record=False, knobs=Knobs(block_size=block_size))
                      for role in (PREFILL, DECODE) for _ in range(replicas)]  # fmt: skip
        self.replicas = replicas
        self.publishers = [Publisher(self.ctx, host) for _ in self.fakes]
        for fake, publisher in zip(self.fakes, self.publishers, strict=True):
            fake.sources = {"0": publisher.config()}
        self.rings: dict[int, list[bytes]] = {}
        self.positions: dict[int, int] = {}
        self.chains = [0] * len(self.fakes)  # fill chains used per publisher
        self.heartbeat = 0.0
        self.pump = Pump()
        self.control_url = ""
        self._runner: web.AppRunner | None = None
        self.started = False  # every fake serving: /fleet answers 503 until then

    def chosen(self, replicas: int | None) -> list[int]:
        """Publisher indexes of the first ``replicas`` prefills and decodes (None: all)."""
        n = self.replicas if replicas is None else min(replicas, self.replicas)
        return [*range(n), *range(self.replicas, self.replicas + n)]

    async def start(self, port: int = 0) -> dict[str, Any]:
        """The control API first: bound after the fakes, its port (chosen free by the caller)
        was now and then taken by one of their 128 servers on port 0 meanwhile."""
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_get("/fleet", self._describe)
        app.router.add_get("/fleet/stats", self._stats)
        for name in ("store", "fill", "pump", "heartbeat", "restart", "knobs"):
            app.router.add_post(f"/fleet/{name}", self._control)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, port).start()
        for fake in self.fakes:
            await fake.start(self.host, 0)
        self.started = True
        bound = self._runner.addresses[0]
        self.control_url = f"http://{bound[0]}:{bound[1]}"
        return self.describe()

    def describe(self) -> dict[str, Any]:
        urls = [f.url for f in self.fakes]
        return {"control": self.control_url, "prefill": urls[: self.replicas],
                "decode": urls[self.replicas :], "block_size": self.block_size}  # fmt: skip

    async def stop(self) -> None:
        for fake in self.fakes:
            await fake.stop()
        if self._runner is not None:
            await self._runner.cleanup()
        for publisher in self.publishers:
            publisher.close()
        self.ctx.term()

    async def run_ticks(self) -> None:
        """Replays, the pump and heartbeats, every tick until cancelled."""
        while True:
            now = time.monotonic()
            for publisher in self.publishers:
                publisher.serve_replays()
            if self.pump.rate:
                self._pump(now)
            if self.heartbeat:
                for publisher in self.publishers:
                    if now - publisher.last_sent >= self.heartbeat:
                        publisher.publish([])
            await asyncio.sleep(max(0.0, TICK_S - (time.monotonic() - now)))

    def _pump(self, now: float) -> None:
        """What the rate owes since the last tick, spread over the publishers; all of it even
        when this process stalled (late, in one batch each, as a stalled engine would)."""
        p = self.pump
        end = min(now, p.until)
        due = p.rate * (end - p.last) + p.carry
        p.last = end
        if now >= p.until:
            p.rate = 0.0
        count = int(due)
        p.carry = due - count
        each, extra = divmod(count, len(p.targets))
        for i, index in enumerate(p.targets):
            n = each + ((i - p.turn) % len(p.targets) < extra)
            if n:
                events, self.positions[index] = workload.take(self.rings[index],
                                                              self.positions[index], n)  # fmt: skip
                self.publishers[index].publish(events)
        p.turn = (p.turn + extra) % len(p.targets)

    # ------------------------------------------------------------------ control
    async def _describe(self, request: web.Request) -> web.Response:
        if not self.started:
            return web.json_response({"error": "starting"}, status=503)
        return web.json_response(self.describe())

    async def _stats(self, request: web.Request) -> web.Response:
        events = [p.events for p in self.publishers]
        return web.json_response({"events": events, "pumping": self.pump.rate > 0})

    async def _control(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        name = request.path.rsplit("/", 1)[1]
        try:
            answer = getattr(self, f"do_{name}")(**body)
        except (TypeError, ValueError, KeyError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response(answer or {})

    def do_store(self, tokens: list[int], replicas: int | None = None) -> dict[str, Any]:
        events = prompt_events(tokens, self.block_size)
        for index in self.chosen(replicas):
            self.publishers[index].publish(events)
        return {"blocks": len(tokens) // self.block_size}

    def do_fill(self, blocks: int, replicas: int | None = None) -> dict[str, Any]:
        for index in self.chosen(replicas):
            events = workload.fill_events(index, self.chains[index], blocks, self.block_size)
            self.chains[index] += -(-blocks // 1024)
            for first in range(0, len(events), 16):  # 16 events of 64 blocks per batch
                self.publishers[index].publish(events[first : first + 16])
        return {"blocks": blocks}

    def do_pump(self, rate: float, seconds: float, replicas: int | None = None) -> dict[str, Any]:
        """Start the churn (rate 0: only build the publishers' rings, ahead of a measurement)."""
        targets = self.chosen(replicas)
        for index in targets:
            if index not in self.rings:
                self.rings[index] = workload.churn_ring(index, self.block_size)
                self.positions[index] = 0
        now = time.monotonic()
        self.pump = Pump(float(rate), now + float(seconds), targets, now)
        return {"publishers": len(targets)}

    def do_heartbeat(self, interval: float) -> None:
        self.heartbeat = float(interval)

    def do_restart(self) -> None:
        self.pump = Pump()
        for publisher in self.publishers:
            publisher.restart()
        self.positions = dict.fromkeys(self.positions, 0)
        self.chains = [0] * len(self.fakes)

    def do_knobs(self, **values: Any) -> None:
        for name in values:
            if not hasattr(Knobs, name):
                raise ValueError(f"no knob {name!r}")
        for fake in self.fakes:
            for name, value in values.items():
                setattr(fake.knobs, name, value)


async def serve(fleet: Fleet, stop: asyncio.Event, port: int = 0) -> None:
    """Start (the control API on ``port``), print the ``fleet {json}`` line, tick until
    ``stop``, stop."""
    print(f"fleet {json.dumps(await fleet.start(port))}", flush=True)
    ticks = asyncio.create_task(fleet.run_ticks())
    try:
        await stop.wait()
    finally:
        ticks.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ticks
        await fleet.stop()
