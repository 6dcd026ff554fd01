"""Running pods: graceful shutdown, Guaranteed QoS, one node per LWS rank, who may reach which
port (NetworkPolicy), pullable images. Each check also runs on a broken copy."""

from __future__ import annotations

import pytest

from tests.k8s import operations as op
from tests.k8s.manifests import find
from tests.k8s.renders import ALL_RENDERS, OVERLAY_NAMES, needs_kubectl, rendered

pytestmark = needs_kubectl


@pytest.mark.parametrize("name", ALL_RENDERS)
def test_graceful_shutdown(name: str) -> None:
    assert op.check_graceful_shutdown(rendered(name)) == []


@pytest.mark.parametrize("name", ALL_RENDERS)
def test_vllm_pods_are_guaranteed_qos(name: str) -> None:
    assert op.check_guaranteed_qos(rendered(name)) == []


@pytest.mark.parametrize("name", ["lws", "xpyd+lws", "router-lws-monitoring", "xpyd+router+lws"])
def test_lws_pods_of_a_group_take_one_node_each(name: str) -> None:
    assert op.check_lws_one_node_each(rendered(name)) == []


@pytest.mark.parametrize("name", ALL_RENDERS)
def test_network_policies(name: str) -> None:
    objs = rendered(name)
    assert find(objs, "NetworkPolicy"), "the NetworkPolicy is in every render"
    assert op.check_network_policies(objs) == []


@pytest.mark.parametrize("name", OVERLAY_NAMES + ["xpyd+lws"])
def test_overlays_pull_pd_proxy_from_a_registry(name: str) -> None:
    assert op.check_proxy_image_from_registry(rendered(name)) == []


def test_the_timings_the_docs_state() -> None:
    assert op.timings(rendered("base")) == {
        "prestop_s": 40,
        "shutdown_timeout_s": 60,
        "grace_s": 120,
    }


# ------------------------------------------------------------------ the checks can fail


def spec(objs: list[dict], name: str) -> dict:
    return find(objs, "Deployment", name)[0]["spec"]["template"]["spec"]


def test_shutdown_check_fails_on_a_short_sleep_no_drain_or_short_grace() -> None:
    objs = rendered("base")
    spec(objs, "pcp-pd-decode")["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][1] = "5"
    assert any("preStop sleep 5s" in p for p in op.check_graceful_shutdown(objs))
    objs = rendered("base")
    args = spec(objs, "pcp-pd-prefill")["containers"][0]["args"]
    del args[args.index("--shutdown-timeout") : args.index("--shutdown-timeout") + 2]
    assert any("no --shutdown-timeout" in p for p in op.check_graceful_shutdown(objs))
    objs = rendered("base")
    spec(objs, "pcp-pd-decode")["terminationGracePeriodSeconds"] = 60
    assert any("grace 60s" in p for p in op.check_graceful_shutdown(objs))
    objs = rendered("base")
    del spec(objs, "pcp-pd-proxy")["containers"][0]["lifecycle"]
    assert any("pd-proxy" in p for p in op.check_graceful_shutdown(objs))


def test_qos_check_fails_on_burstable_pods() -> None:
    objs = rendered("base")
    spec(objs, "pcp-pd-prefill")["containers"][0]["resources"]["requests"]["memory"] = "64Gi"
    assert op.check_guaranteed_qos(objs) == [
        "Deployment/pcp-pd-prefill: QoS Burstable, want Guaranteed"
    ]
    objs = rendered("router")
    del spec(objs, "pcp-pd-decode")["initContainers"][0]["resources"]["limits"]["cpu"]
    assert op.check_guaranteed_qos(objs)  # the routing sidecar counts too
    assert op.qos_class({"containers": [{"name": "c"}]}) == "BestEffort"


def test_lws_check_fails_without_anti_affinity_or_when_it_repels_every_group() -> None:
    objs = rendered("lws")
    lwt = find(objs, "LeaderWorkerSet")[0]["spec"]["leaderWorkerTemplate"]
    del lwt["workerTemplate"]["spec"]["affinity"]
    assert any("may share a node" in p for p in op.check_lws_one_node_each(objs))
    objs = rendered("xpyd+lws")
    lwt = find(objs, "LeaderWorkerSet")[0]["spec"]["leaderWorkerTemplate"]
    term = lwt["leaderTemplate"]["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ][0]
    del term["matchLabelKeys"]
    assert any("repels other groups" in p for p in op.check_lws_one_node_each(objs))


def test_network_policy_check_fails_when_kv_is_open_or_closed() -> None:
    objs = rendered("base")
    objs.remove(find(objs, "NetworkPolicy", "pcp-pd-prefill")[0])
    problems = op.check_network_policies(objs)
    assert any(
        "a stranger pod reaches Deployment/pcp-pd-prefill port nixl-side" in p for p in problems
    )
    objs = rendered("base")
    rule = find(objs, "NetworkPolicy", "pcp-pd-decode")[0]["spec"]["ingress"][0]
    rule["ports"] = [{"protocol": "TCP", "port": "nixl-side"}]  # UCX's range forgotten
    assert any(
        "cannot reach Deployment/pcp-pd-decode port 20000" in p
        for p in op.check_network_policies(objs)
    )
    objs = rendered("base")
    env = spec(objs, "pcp-pd-decode")["containers"][0]["env"]
    next(e for e in env if e["name"] == "UCX_TCP_PORT_RANGE")["value"] = "30000-30999"
    assert any("UCX_TCP_PORT_RANGE differs" in p for p in op.check_network_policies(objs))
    objs = rendered("router")
    objs.remove(find(objs, "NetworkPolicy", "pcp-pd-router")[0])
    assert any("the EPP cannot reach" in p for p in op.check_network_policies(objs))
    objs = rendered("lws")
    objs.remove(find(objs, "NetworkPolicy", "pcp-pd-prefill-group")[0])
    assert any("(same group) cannot reach" in p for p in op.check_network_policies(objs))
    objs = rendered("monitoring")
    objs.remove(find(objs, "NetworkPolicy", "pcp-pd-operator-prometheus")[0])
    assert any("kps Prometheus cannot reach" in p for p in op.check_network_policies(objs))


def test_image_check_fails_on_a_bare_local_name() -> None:
    objs = rendered("base")  # no overlay: the name `make images` tags
    assert op.check_proxy_image_from_registry(objs)
