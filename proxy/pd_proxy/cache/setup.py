"""Whether a proxy plans requests with a ``CacheRouter``, and the one it gets.

The router's libraries (pyzmq, tokenizers, Jinja2) are imported only when it is on, so a proxy
without cache-aware routing starts as fast as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pd_proxy.config import ENV_PREFIX, ConfigError
from pd_proxy.legs import Legs

if TYPE_CHECKING:
    from pd_proxy.cache.router import CacheRouter

OFF = "off"  # pd_proxy.config.CACHE_ROUTING_MODES


def cache_router(legs: Legs) -> CacheRouter | None:
    """A router when cache-aware routing is on, or a local tokenizer can speed up the
    ``--local-prefill-max-tokens`` count; None keeps the proxy's routing as it always was."""
    config = legs.config
    mode = config.prefix_cache_routing
    counts = config.local_prefill_max_tokens > 0 and config.tokenizer is not None
    if mode == OFF and not counts:
        return None
    from pd_proxy.cache.router import CacheRouter
    from pd_proxy.cache.tokens import LocalTokenizer, TokenizerFilesError

    tokenizer = None
    if config.tokenizer is not None:
        try:
            tokenizer = LocalTokenizer(config.tokenizer)
        except TokenizerFilesError as exc:
            raise ConfigError(f"--tokenizer ({ENV_PREFIX}TOKENIZER): {exc}") from None
    return CacheRouter(legs, mode, tokenizer, legs.backend_key)
