"""Where a replica publishes its KV events: vLLM's ``GET /kv_event_sources`` answer, made
reachable from the proxy.

vLLM 0.32's API server answers ``{"<dp rank>": KVEventsConfig}`` with each engine's resolved
publisher config (the port already offset by the DP rank). A wildcard endpoint (``tcp://*:5557``)
means the publisher binds on every interface of the replica's host, so the proxy connects to the
host it reaches the API at. A publisher that *connects* (a concrete host in its endpoint) expects
one subscriber bound at that address: a single-router setup the proxy does not join; such a replica
is treated as publishing no events. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]", "::")


@dataclass(frozen=True)
class Publisher:
    rank: int
    endpoint: str
    replay: str | None
    topic: str


def _tcp_host_port(endpoint: str) -> tuple[str, str] | None:
    if not endpoint.startswith("tcp://"):
        return None
    rest = endpoint[len("tcp://") :]
    host, sep, port = rest.rpartition(":")
    return (host, port) if sep and port.isdigit() else None


def _reachable(endpoint: str | None, api_host: str) -> str | None:
    """``endpoint`` with a wildcard host replaced by the API's host; None if not a bound tcp one."""
    if not endpoint:
        return None
    parts = _tcp_host_port(endpoint)
    if parts is None or parts[0] not in WILDCARD_HOSTS:
        return None
    host = f"[{api_host}]" if ":" in api_host else api_host
    return f"tcp://{host}:{parts[1]}"


def parse_sources(answer: Any, api_host: str) -> tuple[list[Publisher], list[str]]:
    """The publishers the proxy can subscribe to, and a problem line for each it cannot."""
    publishers: list[Publisher] = []
    problems: list[str] = []
    if not isinstance(answer, dict):
        return [], ["/kv_event_sources did not answer a JSON object"]
    for rank_text, cfg in sorted(answer.items()):
        if not isinstance(cfg, dict) or not cfg.get("enable_kv_cache_events"):
            continue
        if cfg.get("publisher") not in (None, "zmq"):
            problems.append(f"rank {rank_text}: publisher {cfg.get('publisher')!r} is not zmq")
            continue
        endpoint = _reachable(cfg.get("endpoint"), api_host)
        if endpoint is None:
            problems.append(
                f"rank {rank_text}: endpoint {cfg.get('endpoint')!r} is not a wildcard tcp bind "
                "(tcp://*:PORT) the proxy can connect to"
            )
            continue
        try:
            rank = int(rank_text)
        except ValueError:
            problems.append(f"rank {rank_text!r} is not a number")
            continue
        replay = _reachable(cfg.get("replay_endpoint"), api_host)
        topic = cfg.get("topic") or ""
        publishers.append(Publisher(rank, endpoint, replay, str(topic)))
    return publishers, problems
