"""Room per replica: what the proxy has admitted to each replica and not yet seen finish, against
the limits. Pure: the gate calls it with the healthy replicas it knows.

Counted for certain by the proxy itself, not guessed from a scrape:
- a prefill replica: requests whose prefill leg runs there, and their uncached prompt tokens;
- a decode replica: requests whose decode leg runs there or will, and among them those whose KV
  sits on a prefill waiting for this decode to pull it (a pull that cannot start within the KV
  lease frees the blocks unread: the prefill's work is lost).
A replica with nothing in flight always has room for one request, however long its prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Limits:
    """Per replica. 0 means no limit."""

    prefill_requests: int = 0
    prefill_tokens: int = 0
    decode_requests: int = 0
    pending_pulls: int = 0


@dataclass
class Usage:
    """What one replica holds for admitted requests."""

    requests: int = 0
    tokens: int = 0
    pulls: int = 0  # decode only: KV held on a prefill, not yet pulled here


@dataclass
class Room:
    limits: Limits
    usage: dict[str, Usage] = field(default_factory=dict)

    def of(self, url: str) -> Usage:
        found = self.usage.get(url)
        if found is None:
            found = self.usage[url] = Usage()
        return found

    def prefill_fits(self, url: str, tokens: int) -> bool:
        u, lim = self.of(url), self.limits
        if u.requests == 0:
            return True
        if lim.prefill_requests and u.requests >= lim.prefill_requests:
            return False
        return not (lim.prefill_tokens and u.tokens + tokens > lim.prefill_tokens)

    def decode_fits(self, url: str, pd: bool) -> bool:
        u, lim = self.of(url), self.limits
        if u.requests == 0:
            return True
        if lim.decode_requests and u.requests >= lim.decode_requests:
            return False
        return not (pd and lim.pending_pulls and u.pulls >= lim.pending_pulls)

    def give_prefill(self, url: str, tokens: int) -> None:
        """A prefill leg on ``url`` answered or ended: its request and tokens go back."""
        use = self.of(url)
        use.requests -= 1
        use.tokens -= tokens

    def forget(self, keep: set[str]) -> None:
        """Drop replicas that left the pools and hold nothing."""
        for url in [u for u, use in self.usage.items() if u not in keep and not use.requests]:
            del self.usage[url]
