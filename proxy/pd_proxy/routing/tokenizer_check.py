"""The local tokenizer's trust: it is used for a request shape only after its ids matched a
decode's ``/tokenize`` on a canary set, since a local tokenizer can disagree with the server (a
template vLLM overrides, a special-token rule).

``tokenizer_check`` builds the check from the settings (``--tokenizer``: a folder or a model id in
the Hugging Face cache); a model id vLLM is still downloading is looked for every round until its
files arrive. ``TokenizerCheck.run`` retries the canary each round until a decode answers.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import aiohttp

from pd_proxy import scheduler
from pd_proxy.backends.pool import BackendPool
from pd_proxy.config import ENV_PREFIX, ConfigError, ProxyConfig
from pd_proxy.config.key_files import BackendKey
from pd_proxy.protocol.codec import dumps
from pd_proxy.protocol.endpoints import Endpoint
from pd_proxy.routing.cache.metrics import CacheMetrics
from pd_proxy.routing.token_count import ids_from_answer, tokenize_body
from pd_proxy.routing.tokenizer import CANARY, SHAPES, LocalTokenizer, TokenizerFilesError
from pd_proxy.routing.tokenizer_files import hub_cache, tokenizer_folder

log = logging.getLogger("pd_proxy.tokenizer")

CHECK_INTERVAL_S = 1.0  # a missing tokenizer or an unanswered canary is tried again this often


class TokenizerCheck:
    def __init__(
        self,
        tokenizer: LocalTokenizer | None,
        decode: BackendPool,
        *,
        backend_key: BackendKey | None,
        timeout: float,
        metrics: CacheMetrics,
        later: Callable[[], LocalTokenizer | None] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.later = later  # loads the tokenizer once its files are there; None: nothing to wait
        self.decode = decode
        self.backend_key = backend_key
        self.timeout = timeout
        self.metrics = metrics
        self.trusted: set[str] = set()
        self.validated = False
        for shape in SHAPES:
            metrics.trusted.labels(shape).set(0)

    def local_ids(self, body: Mapping[str, Any], endpoint: Endpoint) -> list[int] | None:
        """Ids from the local tokenizer when it is trusted for this request's shape, else None."""
        tok = self.tokenizer
        if tok is None or tok.shape_of(body, endpoint) not in self.trusted:
            return None
        return tok.ids(body, endpoint)

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Until the tokenizer is there and checked; a failing round is logged, never fatal."""
        while not self.validated:
            try:
                await self.round(session)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("tokenizer check: round failed")
            if not self.validated:
                await asyncio.sleep(CHECK_INTERVAL_S)

    async def round(self, session: aiohttp.ClientSession) -> None:
        if self.tokenizer is None and self.later is not None:
            self.tokenizer = self.later()
            if self.tokenizer is not None:
                log.info("local tokenizer: its files arrived; checking it against /tokenize")
                self.later = None
        if self.tokenizer is not None:
            await self.validate(session)

    async def validate(self, session: aiohttp.ClientSession) -> None:
        """Compare the local tokenizer with a healthy decode's ``/tokenize`` on the canary set;
        trust each shape whose every canary matched. Returns early (retried) when none answers."""
        tok = self.tokenizer
        backend = scheduler.pick(self.decode)
        if tok is None or backend is None:
            return
        headers = {} if self.backend_key is None else {"Authorization": self.backend_key.header()}
        failed: dict[str, str] = {}
        for shape, endpoint, body in CANARY:
            request = tokenize_body(body, endpoint)
            try:
                async with session.post(
                    backend.endpoint("/tokenize"),
                    data=dumps(request),
                    headers={**headers, "Content-Type": "application/json"},
                    timeout=aiohttp.ClientTimeout(total=self.timeout * 2),
                ) as resp:
                    if resp.status != 200:
                        if shape not in failed:
                            failed[shape] = f"/tokenize answered {resp.status}"
                        continue
                    server = ids_from_answer(await resp.read())
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                log.info("tokenizer check: %s/tokenize: %s (retrying)", backend.url, exc)
                return
            local = tok.ids(body, endpoint)
            if local != server and shape not in failed:
                failed[shape] = f"{body!r}: local {local} != server {server}"
        self.validated = True
        self.trusted = {s for s in SHAPES if s not in failed}
        for shape in SHAPES:
            self.metrics.trusted.labels(shape).set(1 if shape in self.trusted else 0)
            if shape in failed:
                log.warning(
                    "local tokenizer: %s requests go to /tokenize, the canary differed: %s",
                    shape,
                    failed[shape][:300],
                )
            else:
                log.info("local tokenizer: %s requests tokenized in the proxy", shape)


def tokenizer_check(
    config: ProxyConfig,
    decode: BackendPool,
    backend_key: BackendKey | None,
    metrics: CacheMetrics,
) -> TokenizerCheck | None:
    """The check of ``--tokenizer``, or None without one; a folder that is not a tokenizer is a
    ``ConfigError``."""
    if config.tokenizer is None:
        return None
    later = None
    tokenizer = None
    try:
        folder = tokenizer_folder(config.tokenizer, os.environ)
        if folder is not None:
            tokenizer = LocalTokenizer(folder)
    except TokenizerFilesError as exc:
        raise ConfigError(f"--tokenizer ({ENV_PREFIX}TOKENIZER): {exc}") from None
    if folder is None:
        later = partial(_downloaded, config.tokenizer)
        log.warning(
            "local tokenizer: %s is not in the Hugging Face cache (%s) yet; decode's "
            "/tokenize counts until vLLM has downloaded it (looked for every round)",
            config.tokenizer,
            hub_cache(os.environ),
        )
    return TokenizerCheck(
        tokenizer,
        decode,
        backend_key=backend_key,
        timeout=config.health_timeout,
        metrics=metrics,
        later=later,
    )


def _downloaded(model_id: str) -> LocalTokenizer | None:
    """``model_id``'s tokenizer once its files are in the cache (a half-written file: next time)."""
    folder = tokenizer_folder(model_id, os.environ)
    if folder is None:
        return None
    try:
        return LocalTokenizer(folder)
    except TokenizerFilesError:
        return None
