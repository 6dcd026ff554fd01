"""The prompt tokens each leg of the request being served will compute: the cache router sets
them when it plans the request (its uncached tokens on the prefill, or on decode when decode
serves it alone), and ``Legs.exchange`` adds them to the replica's ``tokens_in_flight``
(pd_proxy.routing.pool) while the leg runs there. The scorer (pd_proxy.routing.cache.scorer)
reads that sum as the work queued or running on the replica.

A context variable, because the plan and the legs run in the request's own task (aiohttp starts
one per request, and the tasks a mode starts copy it), while the ``Route`` the legs receive
stays a plain value. A request the router did not plan counts 0 tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar
from types import MappingProxyType

_NONE: Mapping[str, int] = MappingProxyType({})
_LEG_TOKENS: ContextVar[Mapping[str, int]] = ContextVar("pd_proxy_leg_tokens", default=_NONE)


def plan_legs(tokens: Mapping[str, int]) -> None:
    """The tokens this request's legs compute, by pool role (``prefill``, ``decode``)."""
    _LEG_TOKENS.set(MappingProxyType(dict(tokens)))


def leg_tokens(role: str) -> int:
    """The tokens a leg of this request to a ``role`` replica computes (0: not planned)."""
    return _LEG_TOKENS.get().get(role, 0)
