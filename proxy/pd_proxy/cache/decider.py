"""Conditional disaggregation on uncached tokens: a prompt goes to decode alone when the tokens the
chosen decode does *not* hold are at most ``--local-prefill-max-tokens``. With nothing cached that
is the prompt's length, as before; a follow-up turn whose history decode holds goes to decode
alone; a new long prompt still goes P/D. Pure.
"""

from __future__ import annotations

from pd_proxy.cache.metrics import CACHED, LONG, NO_TOKENS, SHORT

LOCAL, PD = "local", "pd"


def decide(prompt_tokens: int | None, cached_tokens: int, local_max: int) -> tuple[str, str]:
    """(path, reason) for a P/D-eligible prompt; ``local_max`` 0 sends everything P/D."""
    if prompt_tokens is None:
        return PD, NO_TOKENS
    uncached = prompt_tokens - max(0, min(cached_tokens, prompt_tokens))
    if local_max <= 0 or uncached > local_max:
        return PD, LONG
    return LOCAL, (SHORT if prompt_tokens <= local_max else CACHED)
