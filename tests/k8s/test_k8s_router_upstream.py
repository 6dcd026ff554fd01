"""The llm-d-router component against the release it pins: the routing sidecar's flags, the Helm
chart's values keys and the EPP's config schema, as read from llm-d/llm-d-router at that tag and
kept as data in tests/k8s/upstream/llm-d-router-<tag>.yaml."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.k8s import checks as ck
from tests.k8s import operations as op
from tests.k8s.manifests import COMPONENTS_DIR, find, params_file, role_templates
from tests.k8s.renders import needs_kubectl, rendered

ROUTER = COMPONENTS_DIR / "llm-d-router"
VERSIONS = params_file(ROUTER / "versions.env")
UPSTREAM_DIR = Path(__file__).parent / "upstream"
ROUTER_RENDERS = ["router", "router-standalone", "router-lws-monitoring", "xpyd+router+lws"]


def upstream() -> dict[str, Any]:
    path = UPSTREAM_DIR / f"llm-d-router-{VERSIONS['ROUTER_CHART_VERSION']}.yaml"
    if not path.exists():
        pytest.fail(
            f"versions.env pins {VERSIONS['ROUTER_CHART_VERSION']} but {path.name} does not exist: "
            "read the sidecar's flags, the chart's values and the config schema at that tag"
        )
    return yaml.safe_load(path.read_text())


def values() -> dict[str, Any]:
    return yaml.safe_load((ROUTER / "router.values.yaml").read_text())


def leaf_paths(doc: Any, prefix: str, free_form: set[str]) -> list[str]:
    if not isinstance(doc, dict) or prefix in free_form:
        return [prefix]
    return [p for k, v in doc.items() for p in leaf_paths(v, f"{prefix}.{k}".strip("."), free_form)]


# ----------------------------------------------------------------------------- checks


def sidecar_problems(args: list[str], facts: dict[str, Any]) -> list[str]:
    """The routing sidecar's arguments, as its flag parser would take them."""
    flags, problems = facts["sidecar"]["flags"], []
    for arg in args:
        name, eq, value = arg.removeprefix("--").partition("=")
        if not arg.startswith("--") or name not in flags:
            problems.append(f"{arg}: not a flag of the sidecar {facts['version']} (it would exit)")
        elif not eq and flags[name] != "bool":
            problems.append(f"{arg}: give the value as --{name}=VALUE")
        elif name == "kv-connector" and value not in facts["sidecar"]["kv_connectors"]:
            problems.append(f"{arg}: not one of {facts['sidecar']['kv_connectors']}")
        elif flags[name] == "bool" and eq and value not in ("true", "false"):
            problems.append(f"{arg}: not a boolean")
    return problems


def values_problems(doc: dict[str, Any], facts: dict[str, Any]) -> list[str]:
    chart = facts["chart"]
    read = set(chart["values_read"])
    problems = [
        f"values key {p} is read by no template of {chart['name']} {facts['version']}"
        for p in leaf_paths(doc, "", set(chart["free_form"]))
        if p not in read
    ]
    epp = doc["router"]["epp"]["image"]
    image = f"{epp['registry']}/{epp['repository']}:{epp['tag']}"
    if image != VERSIONS["ROUTER_EPP_IMAGE"]:
        problems.append(f"EPP image {image} != versions.env {VERSIONS['ROUTER_EPP_IMAGE']}")
    return problems


def config_problems(config: dict[str, Any], facts: dict[str, Any]) -> list[str]:
    schema = facts["epp"]["config"]
    problems = []
    if config.get("apiVersion") not in schema["api_versions"]:
        problems.append(f"apiVersion {config.get('apiVersion')} not in {schema['api_versions']}")
    if config.get("kind") != schema["kind"]:
        problems.append(f"kind {config.get('kind')}")
    problems += [f"unknown field {k}" for k in config if k not in schema["fields"]]
    problems += [f"missing {k}" for k in schema["required"] if k not in config]
    names = set()
    for plugin in config.get("plugins", []):
        problems += [f"plugin field {k}" for k in plugin if k not in schema["plugin_fields"]]
        if plugin.get("type") not in schema["plugin_types"]:
            problems.append(f"plugin type {plugin.get('type')} is not registered")
        names.add(plugin.get("name") or plugin.get("type"))
        if plugin.get("type") == "disagg-profile-handler":
            allowed = schema["disagg_profile_handler_parameters"]
            for group, entries in (plugin.get("parameters") or {}).items():
                if group not in allowed:
                    problems.append(f"disagg-profile-handler parameter {group}")
                    continue
                problems += [f"{group}.{k}" for k in entries if k not in allowed[group]]
                if group == "deciders":
                    declared = {p.get("name") or p.get("type") for p in config["plugins"]}
                    missing = [v for v in entries.values() if v not in declared]
                    problems += [f"decider {v} undeclared" for v in missing]
    profiles = {}
    for profile in config.get("schedulingProfiles", []):
        problems += [f"profile field {k}" for k in profile if k not in schema["profile_fields"]]
        profiles[profile.get("name")] = profile
        for ref in profile.get("plugins", []):
            extra = [k for k in ref if k not in schema["profile_plugin_fields"]]
            problems += [f"profile plugin field {k}" for k in extra]
            if ref.get("pluginRef") not in names:
                problems.append(f"pluginRef {ref.get('pluginRef')} undeclared")
    for profile in schema["default_profiles"].values():
        if profile not in profiles:
            problems.append(f"no scheduling profile {profile}")
    return problems


def sidecars(objs: list[dict]) -> list[dict]:
    return [
        c
        for t in role_templates(objs, "decode")
        for c in t.spec.get("initContainers", [])
        if c.get("restartPolicy") == "Always"
    ]


# ----------------------------------------------------------------------------- tests


def test_the_pinned_release_has_its_facts() -> None:
    facts = upstream()
    tag = VERSIONS["ROUTER_CHART_VERSION"]
    assert facts["version"] == tag and len(facts["commit"]) == 40
    assert VERSIONS["ROUTER_SIDECAR_IMAGE"] == f"{facts['sidecar']['image']}:{tag}"
    assert VERSIONS["ROUTER_EPP_IMAGE"] == f"{facts['epp']['image']}:{tag}"


@needs_kubectl
@pytest.mark.parametrize("name", ROUTER_RENDERS)
def test_sidecar_flags_are_the_pinned_sidecars(name: str) -> None:
    facts = upstream()
    found = sidecars(rendered(name))
    assert found, "no routing sidecar"
    for c in found:
        assert c["image"] == VERSIONS["ROUTER_SIDECAR_IMAGE"]
        assert sidecar_problems(c.get("args", []), facts) == []
        args = dict(a.removeprefix("--").split("=", 1) for a in c["args"])
        assert args["secure-proxy"] == "false"  # plain HTTP in the pod network
        assert not set(args) & set(facts["epp"]["flags_not_in_sidecar"])


def test_values_keys_are_the_charts() -> None:
    assert values_problems(values(), upstream()) == []


def test_plugins_config_matches_the_epps_schema() -> None:
    config = yaml.safe_load(values()["router"]["epp"]["pluginsCustomConfig"]["pcp-pd-kit.yaml"])
    assert config_problems(config, upstream()) == []


@needs_kubectl
@pytest.mark.parametrize("name", ROUTER_RENDERS)
def test_pods_fit_the_router(name: str) -> None:
    """vLLM keeps idle connections longer than the sidecar reuses them; the filters accept the
    pods' role labels; the NetworkPolicy admits the chart's EPP pods; and the pods' grace
    period fits inside the EPP's (the chart asks for that)."""
    facts, objs = upstream(), rendered(name)
    schema, chart = facts["epp"]["config"], facts["chart"]
    for role in ("prefill", "decode"):
        for t in role_templates(objs, role):
            env = ck.container_env(t.container(ck.VLLM_CONTAINER), objs, t.injected)
            keep = int(env.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "5"))
            assert keep > facts["sidecar"]["idle_conn_timeout_s"], t.owner
            if t.role != "worker":
                assert t.labels.get(schema["role_label"]) in schema[f"{role}_roles"]
            _, _, grace = op.shutdown_timings(t, objs)
            assert grace <= chart["epp_termination_grace_s"]
    epp = f"{VERSIONS['ROUTER_RELEASE']}{chart['epp_name_suffix']}"
    selectors = [
        peer["podSelector"]
        for p in find(objs, "NetworkPolicy")
        for rule in p["spec"].get("ingress", [])
        for peer in rule.get("from", [])
        if "podSelector" in peer
    ]
    assert {"matchLabels": {chart["epp_pod_label"]: epp}} in selectors
    assert op.check_network_policies(objs, VERSIONS["ROUTER_RELEASE"]) == []


# ------------------------------------------------------------------ the checks can fail


def test_checks_refuse_what_the_pinned_release_refuses() -> None:
    facts = upstream()
    assert sidecar_problems(["--port=8000", "--secure-serving=false"], facts)
    assert sidecar_problems(["--kv-connector=nixl"], facts)
    assert sidecar_problems(["--vllm-port", "8200"], facts)  # value as its own argument
    doc = copy.deepcopy(values())
    doc["router"]["inferencePool"] = {"targetPorts": [{"number": 8000}]}
    assert values_problems(doc, facts) == [
        "values key router.inferencePool.targetPorts is read by no template of "
        "llm-d-router-standalone v0.9.0"
    ]
    config = yaml.safe_load(values()["router"]["epp"]["pluginsCustomConfig"]["pcp-pd-kit.yaml"])
    broken = {**config, "apiVersion": "llm-d.ai/v1"}
    problems = config_problems(broken, facts)
    assert len(problems) == 1 and problems[0].startswith("apiVersion llm-d.ai/v1 not in")
    broken = copy.deepcopy(config)
    (handler,) = [p for p in broken["plugins"] if p["type"] == "disagg-profile-handler"]
    handler["parameters"]["deciders"]["decode"] = "x"
    broken["schedulingProfiles"][0]["plugins"].append({"pluginRef": "nope"})
    assert config_problems(broken, facts) == [
        "deciders.decode",
        "decider x undeclared",
        "pluginRef nope undeclared",
    ]
