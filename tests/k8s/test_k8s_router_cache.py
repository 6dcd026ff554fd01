"""The llm-d-router component's cache-aware routing (KV-event prefix routing): the EPP's precise
prefix-cache producer fed by the vLLM pods' KV events, the approximate one, the prefix scorers and
prefix-based-pd-decider, checked against the facts read from the pinned release
(tests/k8s/upstream/) and against the pods, the render server and the params they depend on."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from tests.k8s import router_cache as rc
from tests.k8s.manifests import find, params_file
from tests.k8s.renders import needs_kubectl, rendered
from tests.k8s.test_k8s_router_upstream import ROUTER_RENDERS, upstream, values
from tests.support.paths import REPO

PARAMS = REPO / "deploy/k8s/base/params.env"


def epp_config() -> dict[str, Any]:
    return yaml.safe_load(values()["router"]["epp"]["pluginsCustomConfig"]["pcp-pd-kit.yaml"])


def target_port() -> int:
    (port,) = values()["router"]["modelServers"]["targetPorts"]
    return int(port["number"])


def plugin(config: dict[str, Any], name: str) -> dict[str, Any]:
    return rc.plugins_by_name(config)[name]


def vllm_event_encoding() -> tuple[str, dict[str, Any]]:
    """How the installed vLLM puts a BlockStored event on the wire: one batch encoded with vLLM's
    own structs and read back as plain msgpack."""
    events = pytest.importorskip("vllm.distributed.kv_events", reason="needs vLLM installed")
    msgspec = pytest.importorskip("msgspec")
    stored = events.BlockStored(
        block_hashes=[7],
        parent_block_hash=None,
        token_ids=[1, 2],
        block_size=2,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    _, (event,), _ = msgspec.msgpack.decode(
        msgspec.msgpack.encode(events.KVEventBatch(ts=1.0, events=[stored], data_parallel_rank=0))
    )
    if isinstance(event, dict) and "type" in event:
        return "map-tagged-type", event
    return "positional-array", {}


def test_the_pinned_release_decodes_the_installed_vllms_events() -> None:
    """vLLM 0.32 publishes each KV event as a map tagged "type" (its KVCacheEvent has no
    array_like); the pinned release must decode that encoding, or its index stays empty. The
    fields the release reads from a map are ones vLLM sends."""
    facts = upstream()["kv_events"]
    encoding, event = vllm_event_encoding()
    assert encoding in facts["decodes"]
    if encoding == "map-tagged-type":
        required = facts["map_fields_read"]["BlockStored"][:4]
        assert set(required) <= set(event), event
        assert event["type"] == "BlockStored"


def test_the_cache_aware_config_is_the_pinned_releases() -> None:
    config, facts = epp_config(), upstream()
    assert rc.parameter_problems(config, facts) == []
    assert rc.data_layer_problems(config, facts) == []
    assert rc.wiring_problems(config, facts) == []
    types = {p["type"] for p in config["plugins"]}
    assert {rc.PRECISE, rc.APPROX, rc.DECIDER, "token-producer"} <= types
    assert "always-disagg-pd-decider" not in types


def test_the_config_follows_the_params() -> None:
    assert rc.params_problems(epp_config(), params_file(PARAMS)) == []


@needs_kubectl
@pytest.mark.parametrize("name", ROUTER_RENDERS)
def test_vllm_pods_publish_where_the_epp_listens(name: str) -> None:
    objs = rendered(name)
    assert rc.publisher_problems(objs, epp_config(), upstream(), target_port()) == []


@needs_kubectl
@pytest.mark.parametrize("name", ROUTER_RENDERS)
def test_the_token_producer_reaches_a_render_server_of_the_model(name: str) -> None:
    assert rc.render_problems(rendered(name), epp_config(), upstream()) == []


# ------------------------------------------------------------------ the checks can fail


def test_checks_refuse_a_broken_config() -> None:
    facts, config = upstream(), epp_config()
    broken = copy.deepcopy(config)
    events = plugin(broken, rc.PRECISE)["parameters"]["kvEventsConfig"]
    events["socketPort"] = events["podDiscoveryConfig"].pop("socketPort")
    plugin(broken, "queue-scorer")["parameters"] = {"weight": 2}
    assert rc.parameter_problems(broken, facts) == [
        f"{rc.PRECISE}.kvEventsConfig.socketPort: not a parameter the pinned release reads",
        "queue-scorer: queue-scorer ignores its parameters",
    ]
    broken = copy.deepcopy(config)
    broken["dataLayer"]["sources"][0]["extractors"] = []
    assert rc.data_layer_problems(broken, facts) == [
        f"{rc.PRECISE} discovers pods but is no extractor of an endpoint-notification-source: "
        "it would subscribe to no pod"
    ]
    broken = copy.deepcopy(config)
    broken["plugins"] = [p for p in broken["plugins"] if p["type"] != rc.APPROX]
    plugin(broken, rc.DECIDER)["parameters"]["nonCachedTokens"] = 0
    assert rc.wiring_problems(broken, facts) == [
        "approx-prefix-scorer reads producer approx-prefix-cache-producer, which is not declared",
        f"{rc.DECIDER} reads the producer named approx-prefix-cache-producer, which is not "
        "declared: it would never disaggregate",
        f"{rc.DECIDER}: nonCachedTokens 0 turns the prefill leg off for every request",
    ]


def test_checks_refuse_params_the_config_does_not_follow() -> None:
    shipped = params_file(PARAMS)
    configured = int(shipped["LOCAL_PREFILL_MAX_TOKENS"]) + 1  # what router.values.yaml holds
    params = {**shipped, "BLOCK_SIZE": "64", "LOCAL_PREFILL_MAX_TOKENS": "63"}
    params["MODEL_NAME"] = "other/model"
    assert rc.params_problems(epp_config(), params) == [
        "token-producer modelName != MODEL_NAME other/model",
        f"{rc.PRECISE} blockSizeTokens 128 != BLOCK_SIZE 64",
        f"{rc.APPROX} blockSizeTokens 128 != BLOCK_SIZE 64",
        f"{rc.DECIDER} nonCachedTokens {configured} != LOCAL_PREFILL_MAX_TOKENS + 1 = 64",
    ]


@needs_kubectl
def test_checks_refuse_pods_that_publish_elsewhere() -> None:
    objs, config, facts = rendered("router"), epp_config(), upstream()
    pods = {o["metadata"]["name"]: o for o in find(objs, "Deployment")}
    decode = pods["pcp-pd-decode"]["spec"]["template"]["spec"]["containers"][0]
    # The entrypoint builds the config from these (the params' port, the patch's topic).
    decode["env"] += [
        {"name": "KIT_KV_EVENTS_PORT", "value": "6000"},
        {"name": "KIT_KV_EVENTS_TOPIC", "value": "kv"},
    ]
    prefill = pods["pcp-pd-prefill"]["spec"]["template"]["spec"]["containers"][0]
    prefill["args"].append("--no-enable-prefix-caching")
    assert rc.publisher_problems(objs, config, facts, target_port()) == [
        "Deployment/pcp-pd-prefill: prefix caching is not on "
        "(['--enable-prefix-caching', '--no-enable-prefix-caching'])",
        "Deployment/pcp-pd-prefill: no --kv-events-config",
        "Deployment/pcp-pd-decode: publishes on 6000, the EPP dials 5557",
        "Deployment/pcp-pd-decode: topic 'kv', the EPP files "
        "'kv@10.244.1.23:8000@deepseek-ai/DeepSeek-V2-Lite-Chat'",
    ]


@needs_kubectl
def test_checks_refuse_a_render_server_that_cannot_answer() -> None:
    objs, facts = rendered("router"), upstream()
    (render,) = find(objs, "Deployment", rc.RENDER)
    container = render["spec"]["template"]["spec"]["containers"][0]
    container["image"] = "vllm/vllm-openai:v0.33.0"
    container["command"][2] = container["command"][2].replace("launch render", "serve")
    container["env"].append({"name": "VLLM_API_KEY", "value": "x"})
    assert rc.render_problems(objs, epp_config(), facts) == [
        "Deployment/pcp-pd-render runs ['vllm', 'serve', '--model'], not `vllm launch render`",
        "Deployment/pcp-pd-render image vllm/vllm-openai:v0.33.0 differs from the vLLM pods'",
        "Deployment/pcp-pd-render asks for an API key; the token-producer sends none",
    ]
    config = epp_config()
    plugin(config, "token-producer")["parameters"]["vllm"]["url"] = "http://pcp-pd-decode:8200"
    assert rc.render_problems(objs, config, facts) == [
        "Deployment/pcp-pd-decode runs ['python3', '/opt/pcp-pd-kit/entrypoint/vllm_serve', "
        "'--model'], not `vllm launch render`"
    ]
