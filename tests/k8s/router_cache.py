"""Checks for the llm-d-router component's cache-aware routing: the EPP's plugins against the facts
read from the pinned release (tests/k8s/upstream/llm-d-router-<tag>.yaml), and the vLLM pods,
the render server and the params they must agree with. Each returns a list of problems."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from tests.k8s.checks import VLLM_CONTAINER, container_ports, flag, vllm_argv
from tests.k8s.manifests import (
    POD_IP,
    Obj,
    container_env,
    exec_argv,
    find,
    parse_flags,
    pod_templates,
    role_templates,
)

RENDER = "pcp-pd-render"
PRECISE = "precise-prefix-cache-producer"
APPROX = "approx-prefix-cache-producer"
DECIDER = "prefix-based-pd-decider"
PREFIX_SCORER = "prefix-cache-scorer"


def plugins_by_name(config: Mapping[str, Any]) -> dict[str, Obj]:
    """Each plugin under the name the EPP gives it: its `name`, else its type."""
    return {p.get("name") or p.get("type"): p for p in config.get("plugins", [])}


def of_type(config: Mapping[str, Any], kind: str) -> list[Obj]:
    return [p for p in config.get("plugins", []) if p.get("type") == kind]


def unknown_keys(value: Any, allowed: Any, where: str) -> list[str]:
    """Keys of ``value`` the strict decoder would refuse, recursively (``allowed`` None: free)."""
    if allowed is None or not isinstance(value, Mapping):
        return []
    problems = []
    for key, sub in value.items():
        if key not in allowed:
            problems.append(f"{where}.{key}: not a parameter the pinned release reads")
        else:
            problems += unknown_keys(sub, allowed[key], f"{where}.{key}")
    return problems


def parameter_problems(config: Mapping[str, Any], facts: Mapping[str, Any]) -> list[str]:
    """Every plugin's parameters are keys its factory decodes (strictly: another stops the EPP)."""
    schema = facts["epp"]["config"]["plugin_parameters"]
    problems = []
    for name, plugin in plugins_by_name(config).items():
        kind, params = plugin.get("type"), plugin.get("parameters")
        if params is None or kind not in schema:
            continue
        if schema[kind] == {} and params:
            problems.append(f"{name}: {kind} ignores its parameters")
            continue
        problems += unknown_keys(params, schema[kind], name)
    return problems


def data_layer_problems(config: Mapping[str, Any], facts: Mapping[str, Any]) -> list[str]:
    """dataLayer's fields and references; a precise producer that discovers pods is an extractor
    of the endpoint notification source (else it never subscribes to any pod)."""
    schema, plugins = facts["epp"]["config"], plugins_by_name(config)
    layer = config.get("dataLayer") or {}
    problems = [f"dataLayer.{k}" for k in layer if k not in schema["data_layer_fields"]]
    fed: set[str] = set()
    for source in layer.get("sources", []):
        problems += [
            f"dataLayer source field {k}"
            for k in source
            if k not in schema["data_layer_source_fields"]
        ]
        if source.get("pluginRef") not in plugins:
            problems.append(f"dataLayer source {source.get('pluginRef')} undeclared")
        for ext in source.get("extractors", []):
            extra = [k for k in ext if k not in schema["data_layer_extractor_fields"]]
            problems += [f"dataLayer extractor field {k}" for k in extra]
            if ext.get("pluginRef") not in plugins:
                problems.append(f"dataLayer extractor {ext.get('pluginRef')} undeclared")
            elif (
                plugins.get(source.get("pluginRef"), {}).get("type")
                == schema["precise_extractor_source"]
            ):
                fed.add(ext["pluginRef"])
    defaults = facts["kv_events"]["defaults"]
    for name, plugin in plugins_by_name(config).items():
        events = (plugin.get("parameters") or {}).get("kvEventsConfig") or {}
        if plugin.get("type") == PRECISE and events.get("discoverPods", defaults["discoverPods"]):
            if name not in fed:
                problems.append(
                    f"{name} discovers pods but is no extractor of an "
                    f"{schema['precise_extractor_source']}: it would subscribe to no pod"
                )
    return problems


def wiring_problems(config: Mapping[str, Any], facts: Mapping[str, Any]) -> list[str]:
    """The prefix scorers read producers that exist; the P/D decider finds its data and can
    disaggregate at all."""
    schema, plugins = facts["epp"]["config"], plugins_by_name(config)
    problems = []
    for name, plugin in plugins.items():
        if plugin.get("type") != PREFIX_SCORER:
            continue
        producer = (plugin.get("parameters") or {}).get("prefixMatchInfoProducerName") or APPROX
        if plugins.get(producer, {}).get("type") not in schema["match_info_producers"]:
            problems.append(f"{name} reads producer {producer}, which is not declared")
    decider = schema["pd_decider"]
    for name, plugin in plugins.items():
        if plugin.get("type") != decider["type"]:
            continue
        if plugins.get(decider["reads_producer"], {}).get("type") != APPROX:
            problems.append(
                f"{name} reads the producer named {decider['reads_producer']}, which is not "
                "declared: it would never disaggregate"
            )
        if not (plugin.get("parameters") or {}).get("nonCachedTokens"):
            problems.append(
                f"{name}: nonCachedTokens 0 turns the prefill leg off for every request"
            )
    return problems


def params_problems(config: Mapping[str, Any], params: Mapping[str, str]) -> list[str]:
    """The EPP config's copies of pcp-pd-params: the model, whole vLLM blocks, and pd-proxy's
    LOCAL_PREFILL_MAX_TOKENS rule (decode alone up to N tokens to compute, so P/D from N + 1)."""
    problems = []
    for producer in of_type(config, "token-producer"):
        if producer["parameters"].get("modelName") != params["MODEL_NAME"]:
            problems.append(f"token-producer modelName != MODEL_NAME {params['MODEL_NAME']}")
    block = int(params["BLOCK_SIZE"])
    for producer in of_type(config, PRECISE):
        size = producer["parameters"]["tokenProcessorConfig"]["blockSizeTokens"]
        if size != block:
            problems.append(f"{PRECISE} blockSizeTokens {size} != BLOCK_SIZE {block}")
    for producer in of_type(config, APPROX):
        size = producer["parameters"].get("blockSizeTokens")
        if size != block:
            problems.append(f"{APPROX} blockSizeTokens {size} != BLOCK_SIZE {block}")
    want = int(params["LOCAL_PREFILL_MAX_TOKENS"]) + 1
    for decider in of_type(config, DECIDER):
        got = decider["parameters"].get("nonCachedTokens")
        if got != want:
            problems.append(
                f"{DECIDER} nonCachedTokens {got} != LOCAL_PREFILL_MAX_TOKENS + 1 = {want}"
            )
    return problems


def events_config(config: Mapping[str, Any], facts: Mapping[str, Any]) -> dict[str, Any]:
    """The precise producer's effective kvEventsConfig (its parameters over the defaults)."""
    (producer,) = of_type(config, PRECISE)
    given = producer.get("parameters", {}).get("kvEventsConfig") or {}
    defaults = facts["kv_events"]["defaults"]
    return {
        "topicFilter": given.get("topicFilter", defaults["topicFilter"]),
        "socketPort": (given.get("podDiscoveryConfig") or {}).get(
            "socketPort", defaults["socketPort"]
        ),
    }


def publisher_problems(
    objs: list[Obj], config: Mapping[str, Any], facts: Mapping[str, Any], target_port: int
) -> list[str]:
    """Each serving vLLM pod publishes where and under the name the EPP looks: it binds the
    socket port the EPP dials, its topic passes the filter and names the pod as the EPP names its
    endpoints (<pod IP>:<target port>) and the served model; prefix caching stays on."""
    want = events_config(config, facts)
    problems = []
    serving = [
        t for r in ("prefill", "decode") for t in role_templates(objs, r) if t.role != "worker"
    ]
    for t in serving:
        argv = vllm_argv(t, objs)
        env = container_env(t.container(VLLM_CONTAINER), objs, t.injected)
        switches = [
            a for a in argv if a in ("--enable-prefix-caching", "--no-enable-prefix-caching")
        ]
        if not switches or switches[-1] != "--enable-prefix-caching":
            problems.append(f"{t.owner}: prefix caching is not on ({switches or 'no flag'})")
        raw = flag(argv, "--kv-events-config")
        if raw is None:
            problems.append(f"{t.owner}: no --kv-events-config")
            continue
        events = json.loads(raw)
        if events.get("enable_kv_cache_events") is not True or events.get("publisher") != "zmq":
            problems.append(f"{t.owner}: KV events off or not on ZMQ: {events}")
        endpoint = urlsplit(events.get("endpoint", ""))
        if endpoint.netloc.rsplit(":", 1)[0] != "*":
            problems.append(f"{t.owner}: {events.get('endpoint')} connects instead of binding")
        if endpoint.port != want["socketPort"]:
            problems.append(
                f"{t.owner}: publishes on {endpoint.port}, the EPP dials {want['socketPort']}"
            )
        if container_ports(t).get("kv-events") != want["socketPort"]:
            problems.append(f"{t.owner}: container port kv-events != {want['socketPort']}")
        model = flag(argv, "--served-model-name") or flag(argv, "--model")
        topic = f"kv@{POD_IP}:{target_port}@{model}"
        if events.get("topic") != topic or not topic.startswith(want["topicFilter"]):
            problems.append(f"{t.owner}: topic {events.get('topic')!r}, the EPP files {topic!r}")
        if env.get("POD_IP") != POD_IP:
            problems.append(f"{t.owner}: POD_IP is not the pod's IP")
    if not serving:
        problems.append("no serving vLLM pod")
    return problems


def render_problems(
    objs: list[Obj], config: Mapping[str, Any], facts: Mapping[str, Any]
) -> list[str]:
    """The token-producer's URL is the render Service, which selects a `vllm launch render` of
    the served model, in the vLLM pods' image, on the Service's target port."""
    problems = []
    (producer,) = of_type(config, "token-producer")
    url = urlsplit(producer["parameters"]["vllm"]["url"])
    services = find(objs, "Service", url.hostname)
    if url.scheme != "http" or not services:
        return [f"token-producer url {url.geturl()}: no such Service (plain http)"]
    (service,) = services
    port = next((p for p in service["spec"]["ports"] if p["port"] == url.port), None)
    if port is None:
        return [f"Service {url.hostname} has no port {url.port}"]
    pods = [
        t
        for t in pod_templates(objs)
        if all(t.labels.get(k) == v for k, v in service["spec"]["selector"].items())
    ]
    if len(pods) != 1:
        return [f"Service {url.hostname} selects {len(pods)} pod templates"]
    (pod,) = pods
    (container,) = pod.spec["containers"]
    env = container_env(container, objs, pod.injected)
    argv = exec_argv(container, env, ("vllm", "python3"))
    if argv[:3] != ["vllm", "launch", "render"]:
        problems.append(f"{pod.owner} runs {argv[:3]}, not `vllm launch render`")
    flags = parse_flags(argv)[1]
    vllm_pod = role_templates(objs, "decode")[0]
    model = flag(vllm_argv(vllm_pod, objs), "--model")
    if flags.get("--model", [None])[-1] != model or producer["parameters"]["modelName"] != model:
        problems.append(f"{pod.owner} renders {flags.get('--model')}, the pods serve {model}")
    if container["image"] != vllm_pod.container(VLLM_CONTAINER)["image"]:
        problems.append(f"{pod.owner} image {container['image']} differs from the vLLM pods'")
    target = port["targetPort"]
    ports = container_ports(pod)
    listen = int(flags.get("--port", ["8000"])[-1] or 8000)  # vLLM's default port
    if (ports.get(target) if isinstance(target, str) else target) != listen:
        problems.append(f"Service {url.hostname} targets {target}, the server listens on {listen}")
    if "VLLM_API_KEY" in env or any(k.endswith("api-key") for k in flags):
        problems.append(f"{pod.owner} asks for an API key; the token-producer sends none")
    return problems
