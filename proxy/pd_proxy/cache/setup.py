"""Whether a proxy plans requests with a ``CacheRouter``, and the one it gets.

The router's libraries (pyzmq, tokenizers, Jinja2) are imported only when it is on, so a proxy
without cache-aware routing starts as fast as before.
"""

from __future__ import annotations

import logging
import os
from functools import partial
from typing import TYPE_CHECKING

from pd_proxy.config import ENV_PREFIX, ConfigError
from pd_proxy.legs import Legs

if TYPE_CHECKING:
    from pd_proxy.cache.router import CacheRouter
    from pd_proxy.cache.tokens import LocalTokenizer

log = logging.getLogger("pd_proxy.cache")

OFF = "off"  # pd_proxy.config.CACHE_ROUTING_MODES


def cache_router(legs: Legs) -> CacheRouter | None:
    """A router when cache-aware routing is on, or a local tokenizer can speed up the
    ``--local-prefill-max-tokens`` count; None keeps the proxy's routing as it always was."""
    config = legs.config
    mode = config.prefix_cache_routing
    counts = config.local_prefill_max_tokens > 0 and config.tokenizer is not None
    if mode == OFF and not counts:
        return None
    from pd_proxy.cache.hf_cache import hub_cache, tokenizer_folder
    from pd_proxy.cache.router import CacheRouter
    from pd_proxy.cache.tokens import LocalTokenizer, TokenizerFilesError

    tokenizer = None
    later = None
    if config.tokenizer is not None:
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
    return CacheRouter(legs, mode, tokenizer, legs.backend_key, later)


def _downloaded(model_id: str) -> LocalTokenizer | None:
    """``model_id``'s tokenizer once its files are in the cache (a half-written file: next time)."""
    from pd_proxy.cache.hf_cache import tokenizer_folder
    from pd_proxy.cache.tokens import LocalTokenizer, TokenizerFilesError

    folder = tokenizer_folder(model_id, os.environ)
    if folder is None:
        return None
    try:
        return LocalTokenizer(folder)
    except TokenizerFilesError:
        return None
