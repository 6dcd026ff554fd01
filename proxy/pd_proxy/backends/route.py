"""Where one request goes, decided once before any leg: a frozen ``Route``.

The pipeline (pd_proxy.pipeline) plans each P/D-eligible request with pd_proxy.routing.planner
and hands the route to the legs: they go to the replicas it names when those are still healthy,
else to the pool's choice. The log line and the metrics read the same value, so what was decided,
what was sent and what was logged cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal

if TYPE_CHECKING:
    from pd_proxy.backends.pool import Backend

# The two paths, as one type mypy checks: decode alone, or a prefill leg then a decode leg.
RoutePath = Literal["local", "pd"]
LOCAL: Final = "local"
PD: Final = "pd"
PATHS: tuple[RoutePath, ...] = (LOCAL, PD)


@dataclass(frozen=True, slots=True)
class Route:
    """One request's plan.

    ``path`` is ``LOCAL`` or ``PD``; ``reason`` says why (pd_proxy.routing.decider's reasons, or a
    request shape's name). ``decode`` and ``prefill`` are the replicas chosen ahead (None: the
    pool picks when the leg starts). ``prompt_tokens`` counts the prompt's ids when they were
    needed (None: unknown or not asked for; the count, not a copy of an 8k-token prompt's ids:
    nothing after the plan reads them); ``decode_hit`` and ``prefill_hit`` the prompt tokens
    predicted to be in each chosen replica's prefix cache.
    """

    path: RoutePath
    reason: str
    decode: Backend | None = None
    prefill: Backend | None = None
    prompt_tokens: int | None = None
    decode_hit: int = 0
    prefill_hit: int = 0

    def placed(self, decode: Backend | None, prefill: Backend | None) -> Route:
        """This route with its replicas settled (admission's choice where the plan left it)."""
        if decode is self.decode and prefill is self.prefill:
            return self
        return Route(
            self.path,
            self.reason,
            decode,
            prefill,
            self.prompt_tokens,
            self.decode_hit,
            self.prefill_hit,
        )

    @property
    def uncached_tokens(self) -> int | None:
        """Prompt tokens the path's first replica must compute (the prefill's on P/D)."""
        tokens = self.prompt_tokens
        if tokens is None:
            return None
        hit = self.prefill_hit if self.path == PD else self.decode_hit
        return tokens - min(hit, tokens)


# Routes that need no planning: every shape that goes one fixed way.
DEFAULT_PD = Route(PD, "default")
