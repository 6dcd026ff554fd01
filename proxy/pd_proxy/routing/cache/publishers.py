"""Where a replica publishes its KV events: vLLM's ``GET /kv_event_sources`` answer, made
reachable from the proxy.

vLLM 0.32's API server answers ``{"<dp rank>": KVEventsConfig}`` with each engine's resolved
publisher config (the port already offset by the DP rank). A wildcard endpoint (``tcp://*:5557``)
means the publisher binds on every interface of the replica's host, so the proxy connects to the
host it reaches the API at. vLLM binds an endpoint with ``*`` or ``::`` in it and *connects* to
any other; a publisher that connects expects one subscriber bound at that address: a
single-router setup the proxy does not join, so such a replica is treated as publishing no
events. An IPv4-mapped address (``tcp://[::ffff:127.0.0.1]:5557``, what the kit's local stack
uses to keep the events on loopback) is bound on that IPv4 address itself, and the proxy connects
there when it can reach it: a loopback publisher only from a replica whose API is on loopback.
The replay endpoint is always bound. Pure.
"""

from __future__ import annotations

import ipaddress
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


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def _is_loopback(host: str) -> bool:
    ip = _ip(host)
    return host == "localhost" if ip is None else ip.is_loopback


def _bound_ipv4(host: str, always_bound: bool) -> ipaddress.IPv4Address | None:
    """The IPv4 address vLLM binds for an endpoint host that is not a wildcard, if it binds."""
    ip = _ip(host)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped  # "::" in it: vLLM binds, and ZMQ binds the IPv4 address
    if always_bound and isinstance(ip, ipaddress.IPv4Address):
        return ip
    return None


def _reachable(endpoint: str | None, api_host: str, always_bound: bool = False) -> str | None:
    """Where the proxy connects to a publisher's bound ``endpoint`` (a wildcard host: the API's
    host); None when vLLM does not bind it, or binds it where the proxy cannot reach it."""
    if not endpoint:
        return None
    parts = _tcp_host_port(endpoint)
    if parts is None:
        return None
    host, port = parts
    if host in WILDCARD_HOSTS:
        host = f"[{api_host}]" if ":" in api_host else api_host
        return f"tcp://{host}:{port}"
    bound = _bound_ipv4(host, always_bound)
    if bound is None or (bound.is_loopback and not _is_loopback(api_host)):
        return None
    return f"tcp://{bound}:{port}"


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
                f"rank {rank_text}: endpoint {cfg.get('endpoint')!r} is not a tcp endpoint vLLM "
                "binds (tcp://*:PORT, or tcp://[::ffff:IPV4]:PORT) where the proxy can reach it"
            )
            continue
        try:
            rank = int(rank_text)
        except ValueError:
            problems.append(f"rank {rank_text!r} is not a number")
            continue
        replay = _reachable(cfg.get("replay_endpoint"), api_host, always_bound=True)
        topic = cfg.get("topic") or ""
        publishers.append(Publisher(rank, endpoint, replay, str(topic)))
    return publishers, problems
