"""The P/D decider: a prompt goes to decode alone when the tokens the chosen decode does *not*
hold are at most ``--local-prefill-max-tokens``. With nothing cached that is the prompt's length;
a follow-up turn whose history decode holds goes to decode alone; a new long prompt still goes
P/D. Pure.
"""

from __future__ import annotations

from pd_proxy.backends.route import LOCAL, PD, RoutePath

# How a request's path was decided (pd_proxy_path_decisions_total's reason label).
SHORT = "short"  # uncached tokens within --local-prefill-max-tokens, nothing cached: decode alone
CACHED = "cached"  # within the limit only thanks to the decode's cache: decode alone
LONG = "long"  # too many uncached tokens: P/D
NO_TOKENS = "no_tokens"  # the prompt's tokens are unknown: P/D
NO_CHOICE = "no_choice"  # one replica per role and no local prefill: P/D, nothing tokenized
DECISIONS: tuple[tuple[RoutePath, str], ...] = (
    (LOCAL, SHORT),
    (LOCAL, CACHED),
    (PD, LONG),
    (PD, NO_TOKENS),
    (PD, NO_CHOICE),
)


def decide(prompt_tokens: int | None, cached_tokens: int, local_max: int) -> tuple[RoutePath, str]:
    """(path, reason) for a P/D-eligible prompt; ``local_max`` 0 sends everything P/D."""
    if prompt_tokens is None:
        return PD, NO_TOKENS
    uncached = prompt_tokens - max(0, min(cached_tokens, prompt_tokens))
    if local_max <= 0 or uncached > local_max:
        return PD, LONG
    return LOCAL, (SHORT if prompt_tokens <= local_max else CACHED)
