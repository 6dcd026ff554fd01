"""NetworkPolicy ingress semantics, enough to ask "may this pod reach that port of that pod?".

Written from the networking.k8s.io/v1 API reference: a pod selected by at least one policy whose
policyTypes include Ingress admits only what some rule of those policies allows; a rule without
``from`` admits every source, without ``ports`` every port; a peer with a podSelector alone means
pods of the policy's namespace, with a namespaceSelector alone every pod of those namespaces, with
both the matching pods of the matching namespaces; a port may be a number (with ``endPort``, a
range) or the name of a container port of the destination pod. ipBlock peers match no pod here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

Obj = dict[str, Any]

NAMESPACE = "pcp-pd"


def selector_matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A LabelSelector; an empty one matches everything, a missing one nothing."""
    if selector is None:
        return False
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        present = key in labels
        if op == "In" and not (present and labels[key] in values):
            return False
        if op == "NotIn" and present and labels[key] in values:
            return False
        if op == "Exists" and not present:
            return False
        if op == "DoesNotExist" and present:
            return False
    return True


@dataclass(frozen=True)
class Pod:
    """A pod as the policies see it: labels, its namespace's labels, its named container ports."""

    labels: Mapping[str, str]
    namespace: str = NAMESPACE
    ports: Mapping[str, int] = field(default_factory=dict)

    @property
    def namespace_labels(self) -> dict[str, str]:
        return {"kubernetes.io/metadata.name": self.namespace}


def _peer_matches(peer: Obj, source: Pod, policy_namespace: str) -> bool:
    if "ipBlock" in peer:
        return False
    pods, namespaces = peer.get("podSelector"), peer.get("namespaceSelector")
    if namespaces is None:
        in_namespace = source.namespace == policy_namespace
    else:
        in_namespace = selector_matches(namespaces, source.namespace_labels)
    return in_namespace and (pods is None or selector_matches(pods, source.labels))


def _port_matches(rule_port: Obj, port: int, dest: Pod) -> bool:
    if rule_port.get("protocol", "TCP") != "TCP":
        return False
    want = rule_port.get("port")
    if want is None:
        return True
    if isinstance(want, str):
        return dest.ports.get(want) == port
    return int(want) <= port <= int(rule_port.get("endPort", want))


def selecting(policies: list[Obj], dest: Pod) -> list[Obj]:
    """The policies that isolate ``dest`` for ingress."""
    return [
        p
        for p in policies
        if "Ingress" in (p["spec"].get("policyTypes") or ["Ingress"])
        and p.get("metadata", {}).get("namespace", NAMESPACE) == dest.namespace
        and selector_matches(p["spec"].get("podSelector", {}), dest.labels)
    ]


def admits(policies: list[Obj], source: Pod, dest: Pod, port: int | str) -> bool:
    """Whether ``source`` may open a TCP connection to ``port`` (a number, or a name of one of
    ``dest``'s container ports) of ``dest``."""
    number = dest.ports.get(port) if isinstance(port, str) else port
    if number is None:
        raise KeyError(f"the destination has no port named {port!r}")
    chosen = selecting(policies, dest)
    if not chosen:
        return True
    for policy in chosen:
        namespace = policy.get("metadata", {}).get("namespace", NAMESPACE)
        for rule in policy["spec"].get("ingress") or []:
            peers = rule.get("from")
            if peers and not any(_peer_matches(p, source, namespace) for p in peers):
                continue
            ports = rule.get("ports")
            if ports and not any(_port_matches(p, number, dest) for p in ports):
                continue
            return True
    return False
