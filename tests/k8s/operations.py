"""Checks of what happens to running pods: shutdown, QoS, placement, network access, images.

Like tests/k8s/checks.py, each returns a list of problems (empty = fine), so a test can run it on
the real render and on a broken copy.
"""

from __future__ import annotations

from typing import Any

from tests.k8s import netpol
from tests.k8s.checks import (
    PROXY_DEPLOYMENT,
    VLLM_CONTAINER,
    container_ports,
    flag,
    proxy_template,
    vllm_argv,
)
from tests.k8s.manifests import (
    Obj,
    PodTemplate,
    container_env,
    find,
    pod_templates,
    role_templates,
    walk_containers,
)

# CoreDNS's `cache 30` (the kubeadm/kube-dns default Corefile): how long a removed pod's address can
# still be answered from cache, plus pd-proxy's --discovery-interval default for DNS names.
DNS_CACHE_S = 30
DNS_POLL_S = 5
# Seconds between the end of the drain and SIGKILL: process and GPU teardown.
TEARDOWN_S = 10
# pd-proxy's --drain-timeout default (PD_PROXY_DRAIN_TIMEOUT).
PROXY_DRAIN_S = 30


def vllm_templates(objs: list[Obj]) -> list[PodTemplate]:
    return role_templates(objs, "prefill") + role_templates(objs, "decode")


def _prestop_sleep(container: Obj) -> int | None:
    """Seconds of a `preStop` that only sleeps (exec sleep N, or the sleep action)."""
    handler = container.get("lifecycle", {}).get("preStop", {})
    if "sleep" in handler:
        return int(handler["sleep"]["seconds"])
    command = handler.get("exec", {}).get("command", [])
    if len(command) == 2 and command[0] in ("/bin/sleep", "sleep") and command[1].isdigit():
        return int(command[1])
    return None


def shutdown_timings(template: PodTemplate, objs: list[Obj]) -> tuple[int | None, int, int]:
    """(preStop sleep, vLLM --shutdown-timeout, terminationGracePeriodSeconds) of a vLLM pod."""
    container = template.container(VLLM_CONTAINER)
    timeout = flag(vllm_argv(template, objs), "--shutdown-timeout")
    grace = int(template.spec.get("terminationGracePeriodSeconds", 30))
    return _prestop_sleep(container), int(timeout or 0), grace


def check_graceful_shutdown(objs: list[Obj]) -> list[str]:
    """vLLM pods: a preStop sleep longer than a DNS client needs to stop sending, a drain
    (--shutdown-timeout), and a grace period that covers both plus teardown. pd-proxy: a preStop
    sleep and its drain timeout inside its grace period."""
    problems = []
    for t in vllm_templates(objs):
        sleep, timeout, grace = shutdown_timings(t, objs)
        if sleep is None or sleep <= DNS_CACHE_S + DNS_POLL_S:
            problems.append(
                f"{t.owner}: preStop sleep {sleep}s, want > {DNS_CACHE_S + DNS_POLL_S}s "
                f"(CoreDNS cache {DNS_CACHE_S}s + DNS poll {DNS_POLL_S}s)"
            )
        if timeout <= 0:
            problems.append(f"{t.owner}: no --shutdown-timeout: vLLM aborts in-flight requests")
        if grace < (sleep or 0) + timeout + TEARDOWN_S:
            problems.append(
                f"{t.owner}: grace {grace}s < preStop {sleep}s + drain {timeout}s + {TEARDOWN_S}s"
            )
    proxy = proxy_template(objs)
    if proxy is not None:
        container = proxy.spec["containers"][0]
        env = container_env(container, objs, proxy.injected)
        drain = float(env.get("PD_PROXY_DRAIN_TIMEOUT", PROXY_DRAIN_S))
        sleep = _prestop_sleep(container)
        grace = int(proxy.spec.get("terminationGracePeriodSeconds", 30))
        if sleep is None:
            problems.append("pd-proxy: no preStop sleep (new connections during SIGTERM fail)")
        elif grace < sleep + drain + TEARDOWN_S:
            problems.append(f"pd-proxy: grace {grace}s < {sleep}s + drain {drain:g}s + 10s")
    return problems


def qos_class(spec: Obj) -> str:
    """The QoS class Kubernetes gives a pod (init containers count, requests default to limits)."""
    containers = [*spec.get("initContainers", []), *spec.get("containers", [])]
    guaranteed, any_set = True, False
    for c in containers:
        resources = c.get("resources", {})
        limits, requests = resources.get("limits", {}), resources.get("requests", {})
        for name in ("cpu", "memory"):
            limit, request = limits.get(name), requests.get(name, limits.get(name))
            any_set = any_set or limit is not None or request is not None
            if limit is None or str(request) != str(limit):
                guaranteed = False
    return "Guaranteed" if guaranteed else ("Burstable" if any_set else "BestEffort")


def check_guaranteed_qos(objs: list[Obj]) -> list[str]:
    """vLLM pods are Guaranteed (CPU and NUMA pinning need it), extended resources requested as
    much as limited."""
    problems = []
    for t in vllm_templates(objs):
        cls = qos_class(t.spec)
        if cls != "Guaranteed":
            problems.append(f"{t.owner}: QoS {cls}, want Guaranteed")
        for c in walk_containers(t):
            limits = c.get("resources", {}).get("limits", {})
            requests = c.get("resources", {}).get("requests", {})
            for name in set(limits) - {"cpu", "memory"}:
                if name in requests and requests[name] != limits[name]:
                    problems.append(f"{t.owner}/{c['name']}: {name} request != limit")
    return problems


def lws_pod_labels(lws: Obj, group: str, index: int) -> dict[str, str]:
    """The labels the LWS controller puts on pod ``index`` of group ``group``, with the
    template's own."""
    lwt = lws["spec"]["leaderWorkerTemplate"]
    part = (
        lwt["leaderTemplate"] if index == 0 and "leaderTemplate" in lwt else lwt["workerTemplate"]
    )
    return {
        **part.get("metadata", {}).get("labels", {}),
        "leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"],
        "leaderworkerset.sigs.k8s.io/group-index": group,
        "leaderworkerset.sigs.k8s.io/group-key": f"key-{group}",
        "leaderworkerset.sigs.k8s.io/worker-index": str(index),
    }


def _term_matches(term: Obj, own: dict[str, str], other: dict[str, str]) -> bool:
    """A pod (anti-)affinity term, with matchLabelKeys, as the scheduler reads it for ``own``."""
    selector = dict(term.get("labelSelector") or {})
    exprs = list(selector.get("matchExpressions") or [])
    for key in term.get("matchLabelKeys") or []:
        if key in own:
            exprs.append({"key": key, "operator": "In", "values": [own[key]]})
    selector["matchExpressions"] = exprs
    return netpol.selector_matches(selector, other)


def check_lws_one_node_each(objs: list[Obj]) -> list[str]:
    """Each pod of an LWS group refuses a node that already runs a pod of its group (required
    pod anti-affinity on the hostname), and only of its group."""
    problems = []
    for lws in find(objs, "LeaderWorkerSet"):
        lwt = lws["spec"]["leaderWorkerTemplate"]
        size = int(lwt.get("size", 1))
        for index, part in ((0, "leaderTemplate"), (1, "workerTemplate")):
            spec = lwt.get(part, lwt["workerTemplate"])["spec"]
            terms = (
                spec.get("affinity", {})
                .get("podAntiAffinity", {})
                .get("requiredDuringSchedulingIgnoredDuringExecution", [])
            )
            terms = [x for x in terms if x.get("topologyKey") == "kubernetes.io/hostname"]
            own = lws_pod_labels(lws, "0", index)
            mates = [lws_pod_labels(lws, "0", i) for i in range(size) if i != index]
            stranger = lws_pod_labels(lws, "1", 1 - index if size > 1 else 0)
            if not any(all(_term_matches(x, own, m) for m in mates) for x in terms):
                problems.append(
                    f"{lws['metadata']['name']} {part}: may share a node with its group"
                )
            elif all(_term_matches(x, own, stranger) for x in terms):
                problems.append(f"{lws['metadata']['name']} {part}: also repels other groups")
    return problems


# ----------------------------------------------------------------------------- network policy


def _pod(t: PodTemplate, namespace: str = netpol.NAMESPACE) -> netpol.Pod:
    return netpol.Pod(t.labels, namespace, container_ports(t))


def ucx_range(objs: list[Obj]) -> dict[str, str]:
    """UCX_TCP_PORT_RANGE of each vLLM pod template."""
    return {
        t.owner: container_env(t.container(VLLM_CONTAINER), objs, t.injected).get(
            "UCX_TCP_PORT_RANGE", ""
        )
        for t in vllm_templates(objs)
    }


STRANGER = netpol.Pod({"app": "intruder"})
COMPONENT_LABEL = "app.kubernetes.io/component"
ELSEWHERE = netpol.Pod({"app.kubernetes.io/part-of": "pcp-pd-kit"}, namespace="other")


def check_network_policies(objs: list[Obj], router_release: str = "pcp-pd-router") -> list[str]:
    """Who may reach what: the other role on the NIXL side channel and UCX's ports, pd-proxy (or
    the router) on vLLM's port, the monitoring in use on the metrics ports, an LWS group's ranks
    on any port; any other pod, here or in another namespace, on none of them."""
    policies = find(objs, "NetworkPolicy")
    problems = [] if policies else ["no NetworkPolicy"]
    prefills = role_templates(objs, "prefill")
    decodes = role_templates(objs, "decode")
    ranges = set(ucx_range(objs).values())
    if len(ranges) != 1 or not all(ranges) or "-" not in next(iter(ranges)):
        return problems + [f"UCX_TCP_PORT_RANGE differs or is unset: {ucx_range(objs)}"]
    low, high = (int(x) for x in next(iter(ranges)).split("-"))

    def expect(src: netpol.Pod, dst: PodTemplate, port: int | str, want: bool, who: str) -> None:
        if isinstance(port, str) and port not in container_ports(dst):
            return
        if netpol.admits(policies, src, _pod(dst), port) != want:
            verb = "cannot reach" if want else "reaches"
            problems.append(f"{who} {verb} {dst.owner} port {port}")

    for dst in prefills + decodes:
        if not netpol.selecting(policies, _pod(dst)):
            problems.append(f"{dst.owner}: no NetworkPolicy isolates it")
        peers = decodes if dst in prefills else prefills
        for src in peers:
            for port in ("nixl-side", low, high):
                expect(_pod(src), dst, port, True, src.owner)
        for port in ("nixl-side", "http", "kv-events", "kv-replay", low, high, 29500):
            expect(STRANGER, dst, port, False, "a stranger pod")
            expect(ELSEWHERE, dst, port, False, "a pod of another namespace")
    proxy = proxy_template(objs)
    if proxy is not None:
        for dst in prefills + decodes:
            if dst.role != "worker":
                expect(_pod(proxy), dst, "http", True, "pd-proxy")
                # Its cache index subscribes to the KV events (and asks for replays).
                expect(_pod(proxy), dst, "kv-events", True, "pd-proxy")
                expect(_pod(proxy), dst, "kv-replay", True, "pd-proxy")
            expect(_pod(proxy), dst, "nixl-side", False, "pd-proxy")
        expect(STRANGER, proxy, "http", True, "a client pod")
        expect(STRANGER, proxy, "metrics", False, "a stranger pod")
    _component_peers(objs, prefills, decodes, expect, router_release)
    return problems


def _component_peers(objs, prefills, decodes, expect, router_release) -> None:
    """The clients the optional components add (each checked only with its component)."""
    serving = [t for t in prefills + decodes if t.role != "worker"]
    proxy = proxy_template(objs)
    metrics_targets = serving + ([proxy] if proxy is not None else [])
    for dep in find(objs, "Deployment", "pcp-pd-prometheus"):
        prom = netpol.Pod(dep["spec"]["template"]["metadata"]["labels"])
        for dst in metrics_targets:
            expect(prom, dst, "http" if dst is not proxy else "metrics", True, "Prometheus")
    if find(objs, "PodMonitor"):
        operator = netpol.Pod({"app.kubernetes.io/name": "prometheus"}, namespace="monitoring")
        for dst in metrics_targets:
            expect(operator, dst, "http" if dst is not proxy else "metrics", True, "kps Prometheus")
    if any(t.labels.get("llm-d.ai/inference-serving") == "true" for t in serving):
        epp = netpol.Pod({"llm-d-router-gateway": f"{router_release}-epp"})
        for dst in serving:
            expect(epp, dst, "sidecar" if dst in decodes else "http", True, "the EPP")
            # Its precise prefix-cache index subscribes to each pod's KV events.
            expect(epp, dst, "kv-events", True, "the EPP")
        # Its token-producer asks the render server (no API key: nobody else may).
        renders = [t for t in pod_templates(objs) if t.labels.get(COMPONENT_LABEL) == "render"]
        for dst in renders:
            expect(epp, dst, "http", True, "the EPP")
            for src in [STRANGER, ELSEWHERE, *(_pod(t) for t in serving)]:
                expect(src, dst, "http", False, "a pod other than the EPP")
        for src in decodes:
            for dst in [t for t in prefills if t.role != "worker"]:
                expect(_pod(src), dst, "http", True, f"{src.owner}'s sidecar")
    workers = [t for t in prefills if t.role == "worker"]
    leaders = [t for t in prefills if t.role == "leader"]
    for a in workers + leaders:
        for b in workers + leaders:
            expect(_pod(a), b, 29500, True, f"{a.owner} (same group)")


def check_proxy_image_from_registry(objs: list[Obj]) -> list[str]:
    """pd-proxy's image names a registry (an overlay's `images:`): the bare name `make images`
    tags exists on no registry, so the kubelet could not pull it."""
    proxy = proxy_template(objs)
    if proxy is None:
        return []
    image = proxy.spec["containers"][0]["image"]
    first = image.split("/", 1)[0]
    if "/" not in image or not ("." in first or ":" in first or first == "localhost"):
        return [f"{PROXY_DEPLOYMENT} image {image} names no registry: set it with `images:`"]
    return []


def timings(objs: list[Obj]) -> dict[str, Any]:
    """preStop/drain/grace of the first vLLM pod, for the compose comparison."""
    sleep, timeout, grace = shutdown_timings(vllm_templates(objs)[0], objs)
    return {"prestop_s": sleep, "shutdown_timeout_s": timeout, "grace_s": grace}
