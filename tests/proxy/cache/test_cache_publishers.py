"""What vLLM 0.32's GET /kv_event_sources answers for the kit's servers (the compose entrypoint's
wildcard binds, tcp://*:PORT) becomes an endpoint the proxy can reach: the replica's own address,
as the proxy reaches its API."""

from __future__ import annotations

import dataclasses

import pytest

from pd_proxy.routing.cache.publishers import Publisher, parse_sources

pytestmark = pytest.mark.vllm  # the answer is built from vLLM's own config class


def answer(**fields: object) -> dict[str, object]:
    """``{"<dp rank>": config}`` as vLLM's API server serialises its engines' KVEventsConfig."""
    from vllm.config.kv_events import KVEventsConfig

    config = KVEventsConfig(enable_kv_cache_events=True, **fields)  # type: ignore[arg-type]
    return {"0": dataclasses.asdict(config)}


def test_a_wildcard_bind_is_reached_at_the_replicas_address() -> None:
    got = answer(endpoint="tcp://*:5557", replay_endpoint="tcp://*:5558", topic="kv")
    assert parse_sources(got, "172.28.0.5") == (
        [Publisher(0, "tcp://172.28.0.5:5557", "tcp://172.28.0.5:5558", "kv")],
        [],
    )
    v6 = parse_sources(answer(endpoint="tcp://*:5557"), "fd00::5")[0]
    assert v6 == [Publisher(0, "tcp://[fd00::5]:5557", None, "")]


def test_a_connecting_publisher_is_named_not_followed() -> None:
    publishers, problems = parse_sources(answer(endpoint="tcp://10.0.0.1:5557"), "172.28.0.5")
    assert publishers == [] and "is not a tcp endpoint vLLM binds" in problems[0]


def test_events_off_lists_nothing() -> None:
    from vllm.config.kv_events import KVEventsConfig

    off = {"0": dataclasses.asdict(KVEventsConfig())}
    assert parse_sources(off, "172.28.0.5") == ([], [])
