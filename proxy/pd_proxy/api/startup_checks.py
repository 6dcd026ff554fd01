"""The start-up check of what a ``ProxyConfig`` points at: key files, the endpoints file, the pod.

pd_proxy.config only parses (no I/O); this runs once, in the process the operator started (the
``--workers`` supervisor included), before anything serves, and lists every problem at once. Later
changes to the files only log (pd_proxy.api.auth, pd_proxy.discovery.watch re-read them).
"""

from __future__ import annotations

from pd_proxy.config import (
    ENDPOINTS_FLAG,
    ENV_PREFIX,
    KEY_FILES,
    ROLES,
    ConfigError,
    ProxyConfig,
    no_backend,
)
from pd_proxy.config.key_files import KeyFileError, read_key_file
from pd_proxy.config.service_ref import parse_service_ref
from pd_proxy.discovery.endpoints_file import EndpointsFileError, read_endpoints_file
from pd_proxy.discovery.kube_api import InCluster


def validate(config: ProxyConfig) -> None:
    """``ConfigError`` listing every problem of the files and the cluster ``config`` names."""
    problems = key_file_problems(config) + endpoints_problems(config) + cluster_problems(config)
    if problems:
        raise ConfigError(*problems)


def key_file_problems(config: ProxyConfig) -> list[str]:
    """A key file must hold at least one key at start; later changes only log
    (pd_proxy.api.auth)."""
    problems = []
    for name, flag in KEY_FILES:
        path = getattr(config, name)
        if path is None or not path.strip():  # an empty path is pd_proxy.config's problem
            continue
        try:
            read_key_file(path)
        except KeyFileError as exc:
            problems.append(f"{flag} ({ENV_PREFIX}{name.upper()}): {exc}")
    return problems


def endpoints_problems(config: ProxyConfig) -> list[str]:
    """A bad endpoints file, or a role that no source (the file included) gives a backend."""
    path = config.endpoints_file
    if path is None or not path.strip():
        return []
    try:
        found = read_endpoints_file(path)
    except EndpointsFileError as exc:
        return [f"{ENDPOINTS_FLAG} {path}: {exc}"]
    return [
        no_backend(role)
        for role in ROLES
        if not found[role]
        and not getattr(config, role)
        and getattr(config, f"{role}_dns") is None
        and getattr(config, f"{role}_k8s_service") is None
    ]


def cluster_problems(config: ProxyConfig) -> list[str]:
    """``--*-k8s-service`` needs a pod that sees the API server and knows its namespace (or a
    value that names one)."""
    problems = []
    for role in ROLES:
        name = f"{role}_k8s_service"
        value = getattr(config, name)
        if value is None:
            continue
        flag = f"--{role}-k8s-service ({ENV_PREFIX}{name.upper()})"
        try:
            cluster = InCluster.from_environment()
        except ValueError as exc:  # KubeConfigError
            problems.append(f"{flag} {value!r}: {exc}")
            continue
        if parse_service_ref(value).namespace is None and cluster.namespace is None:
            problems.append(f"{flag} {value!r}: the pod has no namespace file: give NAMESPACE/NAME")
    return problems
