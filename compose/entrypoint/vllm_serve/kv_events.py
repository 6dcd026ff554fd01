"""vLLM's --kv-events-config for pd-proxy's cache index, built from the environment.

With KIT_KV_EVENTS_PORT set and prefix caching on, the entrypoint adds --kv-events-config binding
a ZMQ PUB (and a replay ROUTER) on every interface of the container; the proxy finds them at the
server's GET /kv_event_sources. Unset: no events. The Kubernetes pods read the same two params;
llm-d's router names each pod in the topic (KIT_KV_EVENTS_TOPIC, its kv-events-patch.yaml).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from .cpu_topology import prefix_caching_on

# KV cache events for pd-proxy's cache index (compose: .env KV_EVENTS_PORT, KV_EVENTS_REPLAY_PORT):
# with the port set and prefix caching on, the entrypoint adds --kv-events-config binding a ZMQ
# PUB (and a replay ROUTER) on every interface of the container; the proxy finds them at the
# server's GET /kv_event_sources. Unset: no events. The Kubernetes pods read the same two params;
# llm-d's router names each pod in the topic (KIT_KV_EVENTS_TOPIC, its kv-events-patch.yaml).
KV_EVENTS_FLAG = "--kv-events-config"
KV_EVENTS_PORT_ENV = "KIT_KV_EVENTS_PORT"
KV_EVENTS_REPLAY_PORT_ENV = "KIT_KV_EVENTS_REPLAY_PORT"
KV_EVENTS_TOPIC_ENV = "KIT_KV_EVENTS_TOPIC"
KV_EVENTS_TOPIC = "kv"  # the default: pd-proxy subscribes to the topic /kv_event_sources names


def _port(name: str, value: str, knob: str) -> int:
    if not (value.isascii() and value.isdigit() and 1 <= int(value) <= 65535):
        raise ValueError(f"{name}={value!r} ({knob}): want a TCP port, 1-65535")
    return int(value)


def kv_events_flags(env: Mapping[str, str], argv: Sequence[str]) -> list[str]:
    """``--kv-events-config`` publishing on KIT_KV_EVENTS_PORT (replay on
    KIT_KV_EVENTS_REPLAY_PORT) of every interface, when the port is set and prefix caching is on
    (with it off vLLM stores no block, so a publisher would only make the proxy wait for events
    that never come). ValueError for a bad port or when ``argv`` gives the flag as well."""
    raw = env.get(KV_EVENTS_PORT_ENV, "").strip()
    raw_replay = env.get(KV_EVENTS_REPLAY_PORT_ENV, "").strip()
    if not raw:
        if raw_replay:
            raise ValueError(
                f"{KV_EVENTS_REPLAY_PORT_ENV} is set without {KV_EVENTS_PORT_ENV} "
                "(KV_EVENTS_PORT): a replay endpoint needs a publisher"
            )
        return []
    port = _port(KV_EVENTS_PORT_ENV, raw, "KV_EVENTS_PORT")
    replay = None
    if raw_replay:
        replay = _port(KV_EVENTS_REPLAY_PORT_ENV, raw_replay, "KV_EVENTS_REPLAY_PORT")
    if replay == port:
        raise ValueError(
            f"KV_EVENTS_PORT and KV_EVENTS_REPLAY_PORT are both {port}: want two ports"
        )
    if any(a.split("=", 1)[0].replace("_", "-").startswith(KV_EVENTS_FLAG) for a in argv):
        raise ValueError(
            f"{KV_EVENTS_FLAG} is in the arguments (VLLM_EXTRA_ARGS?): the entrypoint builds it "
            f"from {KV_EVENTS_PORT_ENV}; set KV_EVENTS_PORT in .env instead, or leave it empty"
        )
    if not prefix_caching_on(env, argv):
        return []
    config: dict[str, object] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "topic": env.get(KV_EVENTS_TOPIC_ENV, "").strip() or KV_EVENTS_TOPIC,
    }
    if replay is not None:
        config["replay_endpoint"] = f"tcp://*:{replay}"
    return [KV_EVENTS_FLAG, json.dumps(config, separators=(",", ":"))]
