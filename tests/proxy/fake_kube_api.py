"""A Kubernetes API server for EndpointSlices only, speaking the protocol kube-apiserver speaks.

What pd_proxy.discovery.k8s_service relies on, and nothing else:

- ``GET /apis/discovery.k8s.io/v1/namespaces/NS/endpointslices?labelSelector=K=V``: an
  ``EndpointSliceList`` whose ``metadata.resourceVersion`` is the store's version;
- the same with ``watch=1``: a chunked ``200`` of one JSON event per line (``ADDED``,
  ``MODIFIED``, ``DELETED``, ``BOOKMARK`` with ``allowWatchBookmarks``), every event after the
  requested ``resourceVersion`` from the server's history, then live ones, until
  ``timeoutSeconds``; a version older than the history kept is answered, as the real server does,
  by a ``200`` whose only event is ``ERROR`` with a ``410`` ``Status`` ("too old resource
  version"), or, with ``gone_as_status`` (the other answer servers give, e.g. from the watch
  cache), by the HTTP status ``410`` itself;
- bearer-token authentication (``401``), and ``403`` while ``forbidden`` is set (a missing Role).

Tests drive it with EndpointSlice watch events (tests/proxy/data/endpointslices.json): ``apply``
stores one, stamps the next resourceVersion on it and sends it to every matching watch.
"""

from __future__ import annotations

import asyncio
import copy
import json
import ssl
from typing import Any

from aiohttp import web

LIST_PATH = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
SERVICE_LABEL = "kubernetes.io/service-name"


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class FakeKubeApi:
    def __init__(self, namespace: str, token: str, ssl_context: ssl.SSLContext | None = None):
        self.namespace = namespace
        self.token = token
        self.ssl_context = ssl_context
        self.version = 1000
        self.store: dict[str, dict[str, Any]] = {}
        self.history: list[tuple[int, dict[str, Any]]] = []  # (version, event)
        self.oldest = self.version  # versions below this are compacted away (410)
        self.forbidden = False
        self.gone_as_status = False  # 410 Gone as the answer's status, not an ERROR event
        self.always_gone = False  # a broken server: 410 Gone to every watch, even a fresh one
        self.requests: list[tuple[str, dict[str, str]]] = []  # (list|watch, query)
        self._watches: set[asyncio.Queue[dict[str, Any] | None]] = set()
        self._runner: web.AppRunner | None = None
        self.url = ""

    # ------------------------------------------------------------------ driving it
    def apply(self, event: dict[str, Any]) -> int:
        """Store one watch event's object and send the event; returns its resourceVersion."""
        kind = event["type"]
        obj = copy.deepcopy(event["object"])
        self.version += 1
        obj.setdefault("metadata", {})["resourceVersion"] = str(self.version)
        obj["metadata"].setdefault("namespace", self.namespace)
        name = obj["metadata"]["name"]
        if kind == "DELETED":
            self.store.pop(name, None)
        else:
            self.store[name] = obj
        sent = {"type": kind, "object": obj}
        self.history.append((self.version, sent))
        for queue in list(self._watches):
            queue.put_nowait(sent)
        return self.version

    def bookmark(self) -> None:
        """A BOOKMARK at the current version to every watch that asked for bookmarks."""
        mark = {
            "type": "BOOKMARK",
            "object": {
                "kind": "EndpointSlice",
                "apiVersion": "discovery.k8s.io/v1",
                "metadata": {"resourceVersion": str(self.version)},
            },
        }
        for queue in list(self._watches):
            queue.put_nowait(mark)

    def compact(self) -> None:
        """Forget the history: a watch from an older version now gets 410 Gone."""
        self.history.clear()
        self.oldest = self.version + 1

    def end_watches(self) -> None:
        """Close every open watch stream, as the server does when timeoutSeconds runs out."""
        for queue in list(self._watches):
            queue.put_nowait(None)

    @property
    def watching(self) -> int:
        return len(self._watches)

    def lists(self) -> int:
        return sum(1 for kind, _ in self.requests if kind == "list")

    # ------------------------------------------------------------------ serving
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        app = web.Application()
        app.router.add_get(LIST_PATH.format(namespace="{namespace}"), self._endpointslices)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, ssl_context=self.ssl_context)
        await site.start()
        bound_host, bound_port = self._runner.addresses[0][:2]
        scheme = "https" if self.ssl_context else "http"
        self.url = f"{scheme}://{bound_host}:{bound_port}"

    async def stop(self) -> None:
        self.end_watches()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _selected(self, query: dict[str, str]) -> tuple[str | None, web.Response | None]:
        selector = query.get("labelSelector", "")
        key, sep, value = selector.partition("=")
        if key != SERVICE_LABEL or not sep or not value:
            return None, web.json_response(
                status(400, "BadRequest", f"unsupported labelSelector {selector!r}"), status=400
            )
        return value, None

    def _matches(self, obj: dict[str, Any], service: str) -> bool:
        return obj.get("metadata", {}).get("labels", {}).get(SERVICE_LABEL) == service

    async def _endpointslices(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        watch = query.get("watch") in ("1", "true")
        self.requests.append(("watch" if watch else "list", query))
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response(status(401, "Unauthorized", "Unauthorized"), status=401)
        namespace = request.match_info["namespace"]
        if self.forbidden:
            message = (
                f'endpointslices.discovery.k8s.io is forbidden: User "system:serviceaccount:'
                f'{namespace}:pcp-pd-proxy" cannot {"watch" if watch else "list"} resource '
                f'"endpointslices" in API group "discovery.k8s.io" in the namespace "{namespace}"'
            )
            return web.json_response(status(403, "Forbidden", message), status=403)
        service, problem = self._selected(query)
        if problem is not None or service is None:
            return problem or web.Response(status=400)
        if namespace != self.namespace:
            items: list[dict[str, Any]] = []
        else:
            items = [o for o in self.store.values() if self._matches(o, service)]
        if not watch:
            return web.json_response(
                {
                    "kind": "EndpointSliceList",
                    "apiVersion": "discovery.k8s.io/v1",
                    "metadata": {"resourceVersion": str(self.version)},
                    "items": items,
                }
            )
        return await self._watch(request, query, service)

    async def _watch(
        self, request: web.Request, query: dict[str, str], service: str
    ) -> web.StreamResponse:
        since = int(query.get("resourceVersion") or self.version)
        bookmarks = query.get("allowWatchBookmarks") == "true"
        timeout = float(query.get("timeoutSeconds") or 1800)
        too_old = since < self.oldest - 1 or self.always_gone
        message = f"too old resource version: {since} ({self.oldest - 1})"
        if too_old and self.gone_as_status:
            return web.json_response(status(410, "Gone", message), status=410)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)

        async def send(event: dict[str, Any]) -> None:
            await response.write(json.dumps(event).encode() + b"\n")

        if too_old:
            await send({"type": "ERROR", "object": status(410, "Expired", message)})
            return response
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        for version, event in self.history:
            if version > since:
                queue.put_nowait(event)
        self._watches.add(queue)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    break
                if event is None:
                    break
                if event["type"] == "BOOKMARK":
                    if bookmarks:
                        await send(event)
                elif self._matches(event["object"], service):
                    await send(event)
        finally:
            self._watches.discard(queue)
        return response
