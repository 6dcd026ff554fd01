"""A real OTLP/HTTP trace receiver for tests: ``POST /v1/traces`` with protobuf bodies, decoded
with the OpenTelemetry protocol's own messages, spans kept in memory."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class Received:
    """One span as exported: its service, ids (hex) and name, kind and attributes."""

    service: str
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    attributes: dict[str, object]


class Receiver:
    def __init__(self) -> None:
        self.spans: list[Received] = []
        self.url = ""

    async def _traces(self, request: web.Request) -> web.Response:
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        for resource_spans in message.resource_spans:
            attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            service = str(attrs.get("service.name", ""))
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    values: dict[str, object] = {}
                    for a in span.attributes:
                        kind = a.value.WhichOneof("value")
                        values[a.key] = getattr(a.value, kind) if kind else None
                    self.spans.append(
                        Received(
                            service,
                            span.trace_id.hex(),
                            span.span_id.hex(),
                            span.parent_span_id.hex(),
                            span.name,
                            values,
                        )
                    )
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    def trace(self, trace_id: str) -> list[Received]:
        return [s for s in self.spans if s.trace_id == trace_id]

    async def wait_for(self, predicate, timeout: float = 30.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not predicate():
            if loop.time() > deadline:
                raise AssertionError(f"spans never arrived: {[s.name for s in self.spans]}")
            await asyncio.sleep(0.05)


@asynccontextmanager
async def otlp_receiver(host: str = "127.0.0.1") -> AsyncIterator[Receiver]:
    receiver = Receiver()
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/traces", receiver._traces)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, 0)
        await site.start()
        port = runner.addresses[0][1]
        receiver.url = f"http://{host}:{port}/v1/traces"
        yield receiver
    finally:
        await runner.cleanup()
