"""Each prefill backend's KV block size, as its vLLM reports it on ``/metrics``.

``--first-token-from-prefill`` needs it to know whether the prefill's KV blocks have a slot for
the token decode computes itself (pd_proxy.modes.first_token_rewrite.continuation_problem). vLLM
publishes its cache config as the ``vllm:cache_config_info`` gauge, ``block_size`` among the
labels; the ``/metrics`` route needs no API key, the backend key is sent anyway. The fetch uses
the legs' keep-alive client (pd_proxy.http.upstream).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Iterable

from pd_proxy.backends.pool import Backend
from pd_proxy.config.key_files import BackendKey
from pd_proxy.http.connection import UpstreamError
from pd_proxy.http.upstream import Upstream

log = logging.getLogger("pd_proxy.request")

_BLOCK_SIZE = re.compile(rb'^vllm:cache_config_info\{[^\n]*?\bblock_size="(\d+)"', re.M)


def parse_block_size(metrics: bytes) -> int | None:
    """The KV block size in vLLM's ``/metrics`` (``vllm:cache_config_info``), if one is there."""
    sizes = {int(m) for m in _BLOCK_SIZE.findall(metrics)}
    if len(sizes) != 1:
        return None
    (size,) = sizes
    return size if size > 0 else None


class BlockSizes:
    """Block sizes by backend URL.

    A backend's first lookup fetches its size (one fetch per backend at a time); a known size is
    served while it is refreshed every ``ttl`` seconds, and an unreadable one is retried after
    ``retry`` seconds (its requests meanwhile take the normal flow, and one warning says why).
    ``upstream`` is the running app's client; ``timeout`` bounds a fetch.
    """

    def __init__(
        self,
        upstream: Upstream,
        backend_key: BackendKey | None,
        timeout: float,
        ttl: float = 300.0,
        retry: float = 10.0,
    ) -> None:
        self._upstream = upstream
        self.backend_key = backend_key
        self.timeout = timeout
        self.ttl = ttl
        self.retry = retry
        self._known: dict[str, tuple[int | None, float]] = {}  # url -> (size, refresh after)
        self._pending: dict[str, asyncio.Task[None]] = {}
        self._failing: set[str] = set()  # warned about, until a fetch succeeds

    def known(self, backend: Backend) -> int | None:
        entry = self._known.get(backend.url)
        return None if entry is None else entry[0]

    def prefetch(self, backends: Iterable[Backend]) -> None:
        """Start the fetches that are due (before a prefill leg: they run alongside it)."""
        for backend in backends:
            self._refresh(backend)

    async def get(self, backend: Backend) -> int | None:
        """The block size of ``backend``; a first fetch is waited for (up to ``timeout``)."""
        self._refresh(backend)
        size = self.known(backend)
        task = self._pending.get(backend.url)
        if size is not None or task is None:
            return size
        try:
            await asyncio.wait_for(asyncio.shield(task), self.timeout)
        except asyncio.TimeoutError:
            return None
        return self.known(backend)

    def _refresh(self, backend: Backend) -> None:
        url = backend.url
        entry = self._known.get(url)
        if url in self._pending or (entry is not None and time.monotonic() < entry[1]):
            return
        self._pending[url] = asyncio.create_task(self._fetch(backend), name=f"block-size {url}")

    async def _fetch(self, backend: Backend) -> None:
        size = None
        try:
            size = await self._read(backend)
        finally:
            url = backend.url
            self._pending.pop(url, None)
            wait = self.ttl if size is not None else self.retry
            self._known[url] = (size, time.monotonic() + wait)
            if size is not None:
                self._failing.discard(url)
            elif url not in self._failing:
                self._failing.add(url)
                log.warning(
                    "first token from prefill: no KV block size in %s/metrics "
                    "(vllm:cache_config_info); its requests take the normal flow",
                    url,
                )

    async def _read(self, backend: Backend) -> int | None:
        upstream = self._upstream
        headers = {}
        if self.backend_key is not None:
            headers["Authorization"] = self.backend_key.header()
        try:
            resp = await upstream.get(
                backend, "/metrics", headers, upstream.loop.time() + self.timeout, self.timeout
            )
            try:
                data = await resp.read()
                status = resp.status
            finally:
                resp.release()
        except UpstreamError as exc:
            log.debug("block size of %s: %s", backend.url, exc)
            return None
        return parse_block_size(data) if status == 200 else None
